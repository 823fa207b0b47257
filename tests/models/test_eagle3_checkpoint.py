"""An EAGLE-3 draft saved and loaded again has every tensor it had, bit for bit.

Every parameter and buffer is perturbed before saving: freshly built norms are all ones, so a
norm dropped from `model.safetensors` would otherwise reload "equal" to its initial value.
Only the public API is used (constructor, `save_pretrained`, `SpeculatorModel.from_pretrained`).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.proposals import GreedyTokenProposalConfig

VOCAB = 512
DRAFT_VOCAB = 128
# Names of the 0.3.0 checkpoint (what vLLM's Eagle3LlamaForCausalLM loads).
REQUIRED_NAMES = {
    "d2t",
    "t2d",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "embed_tokens.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
}
# Frozen copies of the verifier's own tensors, rebuilt from the verifier, not saved.
NOT_SAVED = set(Eagle3DraftModel._keys_to_ignore_on_save or [])


def persistent_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, read from the module tree (not through the
    `state_dict` the saver uses, so that a tensor the saver drops is still listed here)."""
    persistent = set(torch.nn.Module.state_dict(model, keep_vars=True))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {name: tensor for name, tensor in tensors.items() if name in persistent}


@pytest.fixture(scope="module")
def perturbed_draft(tiny_llama) -> Eagle3DraftModel:
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            num_hidden_layers=1,
            vocab_size=VOCAB,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
        ),
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(tiny_llama), architectures=["LlamaForCausalLM"]
            ),
        ),
    )
    kept = torch.tensor(sorted(range(3, VOCAB, 4)))[:DRAFT_VOCAB]  # a non-trivial d2t
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(DRAFT_VOCAB)
    torch.manual_seed(0)
    draft = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in persistent_tensors(draft).values():
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensor.add_((0.1 * noise).to(tensor.dtype))
    return draft


def test_every_tensor_is_saved_and_reloaded_exactly(perturbed_draft, tmp_path):
    original = {name: t.detach().clone() for name, t in persistent_tensors(perturbed_draft).items()}
    # The perturbation reached every floating tensor: none is constant any more.
    for name, tensor in original.items():
        if tensor.is_floating_point():
            assert tensor.numel() < 2 or float(tensor.float().std()) > 0, name
    perturbed_draft.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.bin")), "weights must be safetensors, no pickles"

    assert all(name.startswith("verifier_") for name in NOT_SAVED), NOT_SAVED
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) >= REQUIRED_NAMES, REQUIRED_NAMES - set(saved)
    assert set(saved) == set(original) - NOT_SAVED
    for name, tensor in saved.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name

    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert type(loaded) is Eagle3DraftModel
    state = persistent_tensors(loaded)
    assert set(state) == set(original)
    for name in set(original) - NOT_SAVED:
        assert torch.equal(state[name], original[name]), f"{name} did not survive the round trip"
