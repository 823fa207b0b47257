"""EAGLE-3 training semantics: output object, targets (D1), teacher forcing (D7), bf16 (D4)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.models.eagle3.output import Eagle3DraftOutput
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
from tests.models.test_eagle3 import DRAFT_VOCAB, batch, eagle3_config


def vocab_maps():
    return build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, DRAFT_VOCAB, 512
    )


@pytest.fixture(scope="module")
def verifier_path(tiny_llama, tmp_path_factory):
    """The tiny Llama with a final norm that is not all ones (so loading it shows)."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        verifier.model.norm.weight.copy_(torch.rand(256) + 0.5)
    path = tmp_path_factory.mktemp("normed_llama")
    verifier.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft(verifier_path) -> Eagle3DraftModel:
    torch.manual_seed(0)
    d2t, t2d = vocab_maps()
    return Eagle3DraftModel(eagle3_config(str(verifier_path)), t2d=t2d, d2t=d2t)


def test_output_is_typed_and_unpacks_like_030(draft):
    out = draft(**batch(), ttt_steps=2)
    assert isinstance(out, Eagle3DraftOutput)
    tokens, loss, metrics = out  # 0.3.0: (draft_tokens, loss, metrics)
    assert tokens is out.draft_tokens and loss is out.loss and metrics is out.metrics
    assert len(tokens) == 2 and out.logits is None
    unscored = draft(
        hidden_states=batch()["hidden_states"], input_ids=batch()["input_ids"], ttt_steps=2
    )
    assert unscored.loss is None and unscored.metrics is None
    # 0.3.0 returned the bare list of draft tokens when not scored.
    assert len(unscored) == 2 and torch.equal(unscored[1], unscored.draft_tokens[1])
    assert [t.shape for t in unscored] == [(1, 24), (1, 24)]


def test_targets_are_the_verifiers_own_logits(draft, verifier_path):
    """D1: verifier_lm_head(verifier_norm(pre-norm last state)) == transformers logits[t2d]."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(
        str(verifier_path), torch_dtype=torch.float32
    ).eval()
    captured = {}
    hook = verifier.model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.setdefault(
            "pre_norm", output[0] if isinstance(output, tuple) else output
        )
    )
    ids = torch.tensor([[0, 17, 250, 3, 99, 41, 7, 300, 12]])
    try:
        with torch.no_grad():
            logits = verifier(ids).logits
    finally:
        hook.remove()
    assert verifier.config.rms_norm_eps == draft.verifier_norm.variance_epsilon
    targets = draft.target_logits(captured["pre_norm"])
    expected = logits[..., draft.t2d]
    torch.testing.assert_close(targets, expected, rtol=1e-5, atol=1e-5)


def test_without_the_norm_targets_are_030s(tiny_llama):
    d2t, t2d = vocab_maps()
    plain = Eagle3DraftModel(
        eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t, use_verifier_norm=False
    )
    assert plain.verifier_norm is None
    state = torch.randn(1, 5, 256)
    torch.testing.assert_close(plain.target_logits(state), state @ plain.verifier_lm_head.weight.T)


def test_verifier_norm_is_frozen_not_saved_and_optional_on_load(draft, tmp_path):
    assert not draft.verifier_norm.weight.requires_grad
    assert not torch.equal(draft.verifier_norm.weight, torch.ones(256)), "norm not loaded"
    draft.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        saved = set(handle.keys())
    assert "verifier_norm.weight" not in saved and "verifier_lm_head.weight" not in saved
    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert loaded.verifier_norm is not None  # left at its initial value until load_verifier_weights
    loaded.load_verifier_weights()
    assert torch.equal(loaded.verifier_norm.weight, draft.verifier_norm.weight)


def _wrapped_verifier(folder, prefix_layout: tuple[str, str, str], eps: float):
    torch.manual_seed(3)
    embed, norm, head = prefix_layout
    tensors = {
        embed: torch.randn(512, 256),
        norm: torch.rand(256) + 0.5,
        head: torch.randn(512, 256),
    }
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "kimi_k25",
        "text_config": {
            "model_type": "deepseek_v3",
            "rms_norm_eps": eps,
            "vocab_size": 512,
            "hidden_size": 256,
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize(
    "layout",
    [
        (
            "language_model.model.embed_tokens.weight",
            "language_model.model.norm.weight",
            "language_model.lm_head.weight",
        ),
        (
            "model.language_model.embed_tokens.weight",
            "model.language_model.norm.weight",
            "lm_head.weight",
        ),
    ],
)
def test_multimodal_verifier_layouts(tmp_path, layout):
    tensors = _wrapped_verifier(tmp_path / "verifier", layout, eps=1e-3)
    d2t, t2d = vocab_maps()
    model = Eagle3DraftModel(eagle3_config(str(tmp_path / "verifier")), t2d=t2d, d2t=d2t)
    assert torch.equal(model.verifier_norm.weight, tensors[layout[1]])
    assert model.verifier_norm.variance_epsilon == 1e-3
    assert torch.equal(model.verifier_lm_head.weight, tensors[layout[2]][t2d])
    assert torch.equal(model.embed_tokens.weight, tensors[layout[0]])


def _recorded_step_inputs(model, **kwargs) -> tuple[list[torch.Tensor], Eagle3DraftOutput]:
    seen: list[torch.Tensor] = []
    hook = model.embed_tokens.register_forward_hook(
        lambda m, args, out: seen.append(args[0].clone())
    )
    try:
        with torch.no_grad():
            out = model(**kwargs)
    finally:
        hook.remove()
    return seen, out


def test_off_policy_tokens_are_exact_teacher_forcing(draft):
    """D7: step k at position i is fed input_ids[i + k] (token x[i+k+1] of the shifted batch)."""
    data = batch(12, seed=4)
    seen, _ = _recorded_step_inputs(draft, **data, ttt_steps=4, use_off_policy_tokens=True)
    ids = data["input_ids"]
    assert len(seen) == 4
    for step, fed in enumerate(seen):
        assert torch.equal(fed[:, : 12 - step], ids[:, step:]), step
        assert torch.equal(fed[:, 12 - step :], torch.zeros(1, step, dtype=ids.dtype)), step


def test_on_policy_tokens_feed_the_drafts_own_argmax(draft):
    data = batch(12, seed=4)
    seen, out = _recorded_step_inputs(draft, **data, ttt_steps=3)
    assert torch.equal(seen[0], data["input_ids"])
    for step in (1, 2):
        previous = out.draft_tokens[step - 1]
        assert torch.equal(seen[step], previous + draft.d2t[previous])


def test_two_layers_under_bf16_autocast_give_finite_loss_and_grads(tiny_llama):
    """D4: fp32 parameters, bf16 compute, several decoder layers."""
    torch.manual_seed(2)
    config = eagle3_config(str(tiny_llama))
    config.transformer_layer_config.num_hidden_layers = 2
    d2t, t2d = vocab_maps()
    model = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
    assert len(model.layers) == 2
    data = batch(40, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**data, lengths=torch.tensor([25, 15]), ttt_steps=3)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for _, p in trained)
    for name, parameter in trained:
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
    assert any(float(p.grad.abs().sum()) > 0 for n, p in trained if n.startswith("layers.1."))
