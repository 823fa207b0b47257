"""The EAGLE-3 training step's GPU-only paths against their plain versions, on a CUDA device
(skipped elsewhere: CI has no GPU). Compiled blocks and flex attention as in training."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _step(model, batch, *, skip: bool, embeddings_need_grad: bool = False, unused: bool = False):
    """Loss, parameter gradients (fp32) and draft tokens of one forward/backward under bf16."""
    model.skip_unscored_rows = skip
    model.skip_unused_positions = unused
    model.zero_grad(set_to_none=True)
    embed = model.embed_tokens.forward
    if embeddings_need_grad:  # sends the first layer's q/k/v through the generic projection
        model.embed_tokens.forward = lambda ids: embed(ids).detach().requires_grad_(True)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch, ttt_steps=3)
        out.loss.backward()
    finally:
        model.embed_tokens.forward = embed
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, [tokens.clone() for tokens in out.draft_tokens]


def _worst_relative_difference(left: dict, right: dict) -> float:
    assert left.keys() == right.keys()
    return max(float((left[n] - right[n]).norm() / right[n].norm()) for n in left)


def test_gpu_paths_match_the_plain_computation():
    from benchmarks.training import PRESETS, build_model, synthetic_batch

    device = torch.device("cuda")
    preset = PRESETS["cpu-small"]
    torch.manual_seed(0)
    model = build_model(preset, device, torch.bfloat16, "auto", None)
    model.train()
    batch = synthetic_batch(preset, 1024, device, torch.bfloat16)
    _step(model, batch, skip=False)  # compiles
    full_loss, full_grads, full_tokens = _step(model, batch, skip=False)
    again_loss, again_grads, _ = _step(model, batch, skip=False)
    assert torch.equal(again_loss, full_loss)
    assert _worst_relative_difference(again_grads, full_grads) == 0.0  # repeatable to the bit
    variants = (
        {"skip": True},
        {"skip": False, "embeddings_need_grad": True},
        {"skip": True, "unused": True},
    )
    for variant in variants:
        loss, grads, tokens = _step(model, batch, **variant)
        torch.testing.assert_close(loss, full_loss, rtol=1e-3, atol=1e-4, msg=str(variant))
        # bf16 compute: the gradients agree to bf16 rounding, not to the bit
        assert _worst_relative_difference(grads, full_grads) < 2e-2, variant
        for mine, theirs in zip(tokens, full_tokens, strict=True):
            computed = mine != -1  # skipped positions: -1 (the last step skips about 30%)
            assert torch.equal(mine[computed], theirs[computed]), variant
        assert 0 < int((tokens[-1] == -1).sum()) < tokens[-1].numel() // 2 or not variant.get(
            "unused"
        )
