"""The EAGLE-3 draft: config and weights round trips, masks, forward, metrics and training."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from speculators_vllm016.config import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.models.eagle3.attention import (
    build_step_zero_mask,
    extend_mask_for_draft_tokens,
)
from speculators_vllm016.models.eagle3.core import compute_accuracy, loss_function
from speculators_vllm016.proposals import GreedyTokenProposalConfig
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

DRAFT_VOCAB = 128


def eagle3_config(verifier_path: str) -> Eagle3SpeculatorConfig:
    layer = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_hidden_layers=1,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_path, architectures=["LlamaForCausalLM"]),
        ),
    )


def draft_model(verifier_path: str) -> Eagle3DraftModel:
    """The tiny draft these tests share, the same weights at every call."""
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, DRAFT_VOCAB, 512
    )
    return Eagle3DraftModel(eagle3_config(verifier_path), t2d=t2d, d2t=d2t)


@pytest.fixture(scope="module")
def draft(tiny_llama) -> Eagle3DraftModel:
    return draft_model(str(tiny_llama))


def batch(total: int = 24, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, total, 3 * 256, generator=generator),
        "input_ids": torch.randint(0, 512, (1, total), generator=generator),
        "verifier_last_hidden_states": torch.randn(1, total, 256, generator=generator),
        "loss_mask": (torch.rand(1, total, generator=generator) > 0.3).long(),
    }


def test_config_json_layout_and_round_trip(tmp_path, tiny_llama):
    config = eagle3_config(str(tiny_llama))
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in (
        "speculators_model_type",
        "architectures",
        "speculators_version",
        "transformer_layer_config",
        "draft_vocab_size",
        "norm_before_residual",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "speculators_config",
    ):
        assert key in saved, key
    assert saved["speculators_model_type"] == "eagle3"
    assert isinstance(saved["transformer_layer_config"], dict)
    assert saved["transformer_layer_config"]["model_type"] == "llama"
    assert saved["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": 3,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": str(tiny_llama), "architectures": ["LlamaForCausalLM"]},
    }
    assert "auto_map" not in saved
    loaded = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert type(loaded) is Eagle3SpeculatorConfig
    fields = set(Eagle3SpeculatorConfig.model_fields)
    assert loaded.model_dump(include=fields) == config.model_dump(include=fields)


def test_vllm_reads_the_config(tmp_path, tiny_llama):
    from vllm.transformers_utils.configs.speculators.base import (
        SpeculatorsConfig as VllmSpeculators,
    )

    eagle3_config(str(tiny_llama)).save_pretrained(tmp_path)
    parsed = VllmSpeculators.from_pretrained(str(tmp_path))
    assert parsed.draft_vocab_size == DRAFT_VOCAB and parsed.hidden_size == 256
    assert parsed.architectures == ["Eagle3LlamaForCausalLM"]
    speculative = VllmSpeculators.extract_vllm_speculative_config(
        json.loads((tmp_path / "config.json").read_text())
    )
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 3}


def test_weights_round_trip_through_the_base_class(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.bin")), "weights must be safetensors, no pickles"
    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert type(loaded) is Eagle3DraftModel
    original = draft.state_dict()
    assert "verifier_lm_head.weight" not in original
    assert set(loaded.state_dict()) == set(original)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_verifier_weights_are_copied(draft, tiny_llama):
    from safetensors.torch import load_file

    verifier = load_file(str(tiny_llama / "model.safetensors"))
    assert torch.equal(draft.embed_tokens.weight, verifier["model.embed_tokens.weight"])
    assert torch.equal(draft.verifier_lm_head.weight, verifier["lm_head.weight"][draft.t2d])
    assert not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.d2t + torch.arange(DRAFT_VOCAB), draft.t2d.nonzero().flatten())


def test_masks_are_causal_per_sample_and_see_own_drafts():
    mask = build_step_zero_mask(torch.tensor([3, 2]), 5, flex=False)[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    ).bool()
    assert torch.equal(mask, expected)
    extended = extend_mask_for_draft_tokens(mask)
    assert extended.shape == (5, 10)
    assert torch.equal(extended[:, 5:], torch.eye(5, dtype=torch.bool))
    padded = build_step_zero_mask(torch.tensor([2]), 4, flex=False)[0, 0]
    assert torch.equal(padded[2:], torch.tensor([[0, 0, 1, 0], [0, 0, 0, 1]]).bool())


def test_forward_shapes_losses_and_step_accuracies(draft):
    tokens, loss, metrics = draft(**batch(), ttt_steps=3)
    assert len(tokens) == 3 and all(t.shape == (1, 24) for t in tokens)
    assert all(int(t.max()) < DRAFT_VOCAB for t in tokens)
    assert torch.isfinite(loss) and loss > 0
    for step in range(3):
        assert 0.0 <= float(metrics[f"full_acc_{step}"]) <= 1.0
        assert 0.0 <= float(metrics[f"cond_acc_{step}"]) <= 1.0
    assert torch.isclose(metrics["loss"], sum(metrics[f"loss_{s}"] for s in range(3)))
    assert (
        draft(
            **{k: v for k, v in batch().items() if k in ("hidden_states", "input_ids")}, ttt_steps=2
        ).__len__()
        == 2
    )


def test_the_head_gradient_is_complete_when_the_last_steps_head_input_gets_its_own(tiny_llama):
    """FSDP2 reduce-scatters the head's gradient when the gradient of the last TTT step's head
    input (`DraftLMHead.mark_read`) exists: the head's whole gradient must be accumulated by
    then, once, and that must be the first thing the backward pass does with it."""
    model = draft_model(str(tiny_llama))
    events: list[str] = []
    model.lm_head.weight.register_post_accumulate_grad_hook(lambda weight: events.append("head"))
    plain = model.lm_head.mark_read

    def marked(tensor=None):
        if tensor is not None:
            tensor.register_hook(lambda grad: events.append("last step's head input"))
        return plain(tensor)

    model.lm_head.mark_read = marked
    model(**batch(seed=0), ttt_steps=3).loss.backward()
    assert events == ["head", "last step's head input"]


def test_packed_samples_do_not_see_each_other(draft):
    first, second = batch(10, seed=1), batch(14, seed=2)
    packed = {
        key: torch.cat([first[key], second[key]], dim=1)
        for key in ("hidden_states", "input_ids", "verifier_last_hidden_states")
    }
    with torch.no_grad():
        together = draft(
            **packed,
            lengths=torch.tensor([10, 14]),
            position_ids=torch.cat([torch.arange(1, 11), torch.arange(1, 15)])[None],
            ttt_steps=2,
        )
        alone = draft(**{k: first[k] for k in packed}, ttt_steps=2)
    for step in range(2):
        assert torch.equal(together[0][step][:, :10], alone[0][step])


def test_metrics_functions():
    targets = torch.tensor([[[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]]])
    logits = torch.tensor([[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    full, conditional = compute_accuracy(logits, targets, None, None)
    assert torch.isclose(full, torch.tensor(2 / 3), atol=1e-4)
    previous = torch.tensor([[True, True, False]])
    full, conditional = compute_accuracy(logits, targets, None, previous)
    assert torch.isclose(full, torch.tensor(1 / 3), atol=1e-4)  # right now and before
    assert torch.isclose(conditional, torch.tensor(1 / 2), atol=1e-4)
    assert float(loss_function(targets, targets, None)) == pytest.approx(0.0, abs=1e-6)
    masked = loss_function(logits, targets, torch.tensor([[1, 0, 1]]))
    assert float(masked) < float(loss_function(logits, targets, None))


def test_a_few_optimizer_steps_lower_the_loss(tiny_llama):
    torch.manual_seed(1)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512
    )
    model = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    data = batch(32, seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        _, loss, _ = model(**data, ttt_steps=2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses


def test_bad_vocab_maps_are_refused(tiny_llama):
    config = eagle3_config(str(tiny_llama))
    with pytest.raises(ValueError, match="t2d marks"):
        Eagle3DraftModel(
            config,
            t2d=torch.zeros(512, dtype=torch.bool),
            d2t=torch.zeros(DRAFT_VOCAB, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="d2t has shape"):
        Eagle3DraftModel(
            config, t2d=torch.zeros(512, dtype=torch.bool), d2t=torch.zeros(5, dtype=torch.long)
        )


def test_speculative_generate_reproduces_the_verifiers_greedy_output(draft, tiny_llama):
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(
        str(tiny_llama), torch_dtype=torch.float32
    ).eval()
    prompt = torch.tensor([[0, 17, 250, 3, 99, 41, 7]])
    with torch.no_grad():
        greedy = verifier.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=1
        )
    if draft.verifier_attachment_mode != "detached":
        draft.detach_verifier()  # built "train_only"; one verifier at a time, as in 0.3.0
    draft.attach_verifier(verifier, mode="full")
    try:
        speculative = draft.generate(prompt, max_new_tokens=12, num_speculative_tokens=3)
    finally:
        draft.detach_verifier()
    assert torch.equal(speculative, greedy)
    assert draft.last_acceptance["proposed"] >= 3
    with pytest.raises(RuntimeError, match="attach a verifier"):
        draft.generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("oracle", [True, False])
def test_verification_accepts_right_and_rejects_wrong_proposals(
    draft, tiny_llama, monkeypatch, oracle
):
    """Proposals from an oracle (the verifier's own continuation) or always wrong ones."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(
        str(tiny_llama), torch_dtype=torch.float32
    ).eval()
    prompt = torch.tensor([[0, 5, 6, 7, 8]])
    with torch.no_grad():
        greedy = verifier.generate(
            prompt, max_new_tokens=13, do_sample=False, eos_token_id=None, pad_token_id=1
        )

    def propose(hidden_states, tokens, count):
        start = tokens.shape[1]
        truth = greedy[0, start : start + count]
        truth = torch.cat([truth, truth.new_zeros(count - len(truth))])
        return truth if oracle else (truth + 1) % 512

    monkeypatch.setattr(draft, "propose_tokens", propose)
    if draft.verifier_attachment_mode != "detached":
        draft.detach_verifier()  # built "train_only"; one verifier at a time, as in 0.3.0
    draft.attach_verifier(verifier, mode="full")
    try:
        speculative = draft.generate(prompt, max_new_tokens=13, num_speculative_tokens=4)
    finally:
        draft.detach_verifier()
    assert torch.equal(speculative, greedy)
    acceptance = draft.last_acceptance
    if oracle:
        assert acceptance["accepted"] >= acceptance["proposed"] - 4  # the last round may overshoot
        assert acceptance["accepted"] >= 8
    else:
        assert acceptance["accepted"] == 0
