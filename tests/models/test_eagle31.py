"""EAGLE-3.1 (`fc_norm`, `norm_output`) and `norm_before_fc` in our Llama-layer draft.

Config keys and weight names are upstream speculators 0.7's (what vLLM >= 0.22 reads); a draft
with every switch off is exactly the EAGLE-3 draft it was before (config and weights).
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.models.eagle3.proposer import Eagle3Proposer
from tests.evaluate.drafts import VOCAB, build_draft

K = 3


def _randomize_norms(draft: Eagle3DraftModel, seed: int = 1) -> Eagle3DraftModel:
    """Norm weights away from their initial ones, so that a norm left out shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if "norm" in name and parameter.requires_grad:
                parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))
    return draft


def test_all_switches_off_is_the_eagle3_draft(tiny_llama, tmp_path):
    plain = build_draft(str(tiny_llama), seed=3)
    explicit = build_draft(str(tiny_llama), seed=3, fc_norm=False, norm_output=False)
    assert plain.state_dict().keys() == explicit.state_dict().keys()
    assert not any("fc_norm" in k or "input_norm" in k for k in plain.state_dict())
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in explicit.state_dict().items())
    plain.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("fc_norm", "norm_output", "norm_before_fc"):
        assert key not in saved  # an EAGLE-3 config.json is byte for byte what it was


def test_switches_are_saved_under_upstream_keys_and_reload(tiny_llama, tmp_path):
    draft = _randomize_norms(build_draft(str(tiny_llama), fc_norm=True, norm_output=True))
    names = set(draft.state_dict())
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names
    draft.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["fc_norm"], saved["norm_output"], saved["norm_before_fc"]) == (True, True, False)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert loaded.config.fc_norm and loaded.config.norm_output
    assert torch.equal(loaded.fc_norm[2].weight, draft.fc_norm[2].weight)

    before_fc = build_draft(str(tiny_llama), norm_before_fc=True)
    assert tuple(before_fc.state_dict()["input_norm.weight"].shape) == (3 * 256,)


def test_fc_norm_and_norm_before_fc_exclude_each_other():
    with pytest.raises(ValidationError, match="exclude each other"):
        Eagle3SpeculatorConfig(fc_norm=True, norm_before_fc=True)


def _rms_by_hand(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("switch", ["fc_norm", "norm_before_fc"])
def test_fusion_norms_apply_before_fc(tiny_llama, switch):
    draft = _randomize_norms(build_draft(str(tiny_llama), **{switch: True})).double()
    states = torch.randn(1, 6, 3 * 256, dtype=torch.float64)
    if switch == "fc_norm":  # each state normed on its own, with its own weight
        parts = states.chunk(3, dim=-1)
        normed = torch.cat([_rms_by_hand(p, n.weight) for p, n in zip(parts, draft.fc_norm)], -1)
    else:  # one norm over the three side by side
        normed = _rms_by_hand(states, draft.input_norm.weight)
    with torch.no_grad():
        torch.testing.assert_close(
            draft.fuse_aux_states(states), draft.fc(normed), atol=1e-5, rtol=1e-5
        )
        assert not torch.allclose(draft.fuse_aux_states(states), draft.fc(states), atol=1e-2)


def _first_layer_inputs(draft: Eagle3DraftModel, steps: int) -> tuple[list, list]:
    """The hidden state each TTT step's first layer reads, and what each step's layers return."""
    inputs, outputs = [], []

    def hook(module, args, kwargs, output):
        inputs.append(args[0].detach().clone())
        outputs.append(output.detach().clone())

    handle = draft.layers[0].register_forward_hook(hook, with_kwargs=True)
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            draft(
                torch.randn(1, 10, 3 * 256, generator=generator, dtype=torch.float64),
                torch.randint(0, VOCAB, (1, 10), generator=generator),
                ttt_steps=steps,
            )
    finally:
        handle.remove()
    return inputs, outputs


@pytest.mark.parametrize("norm_output", [False, True])
def test_each_step_reads_the_previous_state_normed_only_with_norm_output(tiny_llama, norm_output):
    draft = _randomize_norms(build_draft(str(tiny_llama), norm_output=norm_output)).double()
    inputs, outputs = _first_layer_inputs(draft, 3)
    for step in (1, 2):
        previous = outputs[step - 1]
        expected = draft.norm(previous) if norm_output else previous
        torch.testing.assert_close(inputs[step], expected, rtol=0, atol=0)


def test_training_loss_and_gradients_reach_the_new_norms(tiny_llama):
    draft = _randomize_norms(build_draft(str(tiny_llama), fc_norm=True, norm_output=True)).train()
    generator = torch.Generator().manual_seed(0)
    out = draft(
        torch.randn(1, 16, 3 * 256, generator=generator),
        torch.randint(0, VOCAB, (1, 16), generator=generator),
        verifier_last_hidden_states=torch.randn(1, 16, 256, generator=generator),
        loss_mask=torch.ones(1, 16, dtype=torch.long),
        ttt_steps=3,
    )
    out.loss.backward()
    assert all(
        norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0 for norm in draft.fc_norm
    )


@pytest.fixture(scope="module")
def verifier(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64).eval()


def test_incremental_proposer_matches_the_uncached_eagle31_draft(tiny_llama, verifier):
    """The `hf` eval engine's proposer runs 3.1 as training does (fusion norms, normed feedback)."""
    draft = _randomize_norms(
        build_draft(str(tiny_llama), seed=5, fc_norm=True, norm_output=True)
    ).double()
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, VOCAB, (30,), generator=generator)
    with torch.no_grad():
        states = verifier(sequence[None], output_hidden_states=True).hidden_states
    proposer = Eagle3Proposer(draft, K)
    filled = 0
    for end in (6, 9, 13, 14, 20):
        new = end - filled
        batch = tuple(layer[:, filled:end] for layer in states)
        tokens = sequence[filled + 1 : end + 1][None]
        proposed = proposer.propose(batch, tokens, torch.ones(1, new, dtype=torch.bool))
        views = tuple(layer[:, :end] for layer in states)
        expected = draft.propose_tokens(views, sequence[: end + 1][None], K)
        assert proposed[0].tolist() == expected.tolist(), end
        filled = end
