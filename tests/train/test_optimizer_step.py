"""clip_and_step: the clip folded into a fused AdamW equals clip_grad_norm_ then step()."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.train.optimizer_step import clip_and_step, folds_clip_into_step


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator))
        for shape in ((40, 24), (24,), (7, 3))
    ]


def _set_grads(params: list[torch.nn.Parameter], scale: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for parameter in params:
        parameter.grad = torch.randn(parameter.shape, generator=generator) * scale


@pytest.mark.parametrize("grad_scale", [30.0, 0.001], ids=["clipped", "below-the-norm"])
def test_folded_clip_matches_clip_then_step(grad_scale):
    folded, reference = _params(), _params()
    fused = torch.optim.AdamW(folded, lr=1e-2, weight_decay=0.1, fused=True)
    plain = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    assert folds_clip_into_step(fused)
    for step in range(3):
        _set_grads(folded, grad_scale, seed=step)
        _set_grads(reference, grad_scale, seed=step)
        norm = clip_and_step(fused, folded, max_norm=1.0)
        expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
        plain.step()
        assert float(norm) == pytest.approx(float(expected), rel=1e-6)
        for mine, theirs in zip(folded, reference, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert fused.grad_scale is None  # a later plain step() divides by nothing


def test_unfused_optimizers_get_the_plain_clip():
    mine, reference = _params(), _params()
    optimizer = torch.optim.AdamW(mine, lr=1e-2, foreach=True)
    plain = torch.optim.AdamW(reference, lr=1e-2, foreach=True)
    assert not folds_clip_into_step(optimizer)
    assert not folds_clip_into_step(torch.optim.SGD(_params(), lr=0.1))
    _set_grads(mine, 30.0, seed=0)
    _set_grads(reference, 30.0, seed=0)
    norm = clip_and_step(optimizer, mine, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    plain.step()
    assert torch.equal(norm, expected)
    for left, right in zip(mine, reference, strict=True):
        assert torch.equal(left, right)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_step_with_non_finite_gradients_changes_nothing(fused, bad):
    params = _params()
    optimizer = torch.optim.AdamW(
        params, lr=1e-2, weight_decay=0.1, fused=fused or None, foreach=None if fused else True
    )
    _set_grads(params, 1.0, seed=0)
    clip_and_step(optimizer, params, max_norm=1.0)  # one good step: there is state to protect
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in optimizer.state[params[0]].items()}
    _set_grads(params, 1.0, seed=1)
    params[1].grad[3] = bad
    norm = clip_and_step(optimizer, params, max_norm=1.0)
    assert not torch.isfinite(norm)
    assert getattr(optimizer, "found_inf", None) is None  # a later plain step() must not skip
    for parameter, old in zip(params, before, strict=True):
        assert torch.equal(parameter.detach(), old)
    for key, value in optimizer.state[params[0]].items():
        assert torch.equal(value, state[key]), key
    # The next good step goes through, as the second step of the run.
    _set_grads(params, 1.0, seed=2)
    clip_and_step(optimizer, params, max_norm=1.0)
    assert float(optimizer.state[params[0]]["step"]) == 2.0
    assert all(not torch.equal(p.detach(), old) for p, old in zip(params, before, strict=True))
