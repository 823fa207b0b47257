"""0.3.0's `speculators.convert.eagle.eagle3_legacy_model`: importable, same weights, working."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
from speculators_vllm016.convert.eagle.eagle3_legacy_model import (
    Eagle3Attention,
    Eagle3DecoderLayer,
    Eagle3Speculator,
)
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.models.eagle3.model_definitions import LlamaDecoderEagle3FirstLayer
from speculators_vllm016.proposals import GreedyTokenProposalConfig

H, VOCAB, DRAFT_VOCAB = 64, 96, 32


def layer_config() -> LlamaConfig:
    config = LlamaConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )
    config._attn_implementation = "eager"
    return config


def make_config(norm_before_residual: bool = False) -> Eagle3SpeculatorConfig:
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config(),
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=norm_before_residual,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig()],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )


def test_import_paths_of_0_3_0():
    import speculators.convert.eagle.eagle3_legacy_model as legacy

    assert legacy.__all__ == ["Eagle3Speculator"]
    assert legacy.Eagle3Speculator is Eagle3Speculator
    assert (
        legacy.Eagle3DecoderLayer is Eagle3DecoderLayer
        and legacy.Eagle3Attention is Eagle3Attention
    )
    # Not registered: EAGLE-3 folders load as Eagle3DraftModel.
    assert Eagle3Speculator not in SpeculatorModel.registered_classes()


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_decoder_layer_computes_what_the_training_draft_computes(norm_before_residual: bool):
    torch.manual_seed(0)
    ours = Eagle3DecoderLayer(layer_config(), 0, norm_before_residual=norm_before_residual)
    for parameter in ours.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    reference = LlamaDecoderEagle3FirstLayer(layer_config(), 0, norm_before_residual)
    reference.load_state_dict(ours.state_dict())  # strict: same names and shapes
    inputs = torch.randn(2, 5, 2 * H)
    positions = torch.arange(5).expand(2, -1)
    rotary = LlamaRotaryEmbedding(config=layer_config())(inputs, positions)
    causal = torch.full((5, 5), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        got = ours(inputs, attention_mask=causal, position_embeddings=rotary)[0]
        expected = reference(inputs, attention_mask=causal, position_embeddings=rotary)
    assert torch.allclose(got, expected, atol=1e-5)


def test_speculator_weights_load_into_eagle3_draft_model(tmp_path: Path):
    torch.manual_seed(0)
    legacy = Eagle3Speculator(make_config())
    with torch.no_grad():
        legacy.d2t.copy_(torch.arange(DRAFT_VOCAB))
        legacy.t2d[::3] = True
    legacy.save_pretrained(tmp_path)
    draft = SpeculatorModel.from_pretrained(tmp_path)  # refuses if any weight were missing
    assert type(draft) is Eagle3DraftModel
    state = draft.state_dict()
    for name, tensor in legacy.state_dict().items():
        assert torch.equal(state[name], tensor), name
    again = Eagle3Speculator.from_pretrained(tmp_path)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in legacy.state_dict().items())
    without_maps = Eagle3Speculator(
        make_config(), reduce_vocab_size=False, has_drafter_embedding=False
    )
    assert not {"d2t", "t2d", "embed_tokens.weight"} & set(without_maps.state_dict())


def test_forward_is_causal_and_caches():
    torch.manual_seed(0)
    model = Eagle3Speculator(make_config()).eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    hidden = torch.randn(2, 6, 3 * H)
    with torch.no_grad():
        full = model(ids, hidden, return_dict=False)
        assert full.shape == (2, 6, DRAFT_VOCAB)
        prefix = model(ids[:, :4], hidden[:, :4]).logits
        assert torch.allclose(prefix, full[:, :4], atol=1e-5)
        first = model(ids[:, :4], hidden[:, :4], use_cache=True)
        rest = model(
            ids[:, 4:], hidden[:, 4:], past_key_values=first.past_key_values, use_cache=True
        )
        assert torch.allclose(rest.logits, full[:, 4:], atol=1e-5)
    with pytest.raises(ValueError, match="do not pair"):
        model(ids, hidden[:, :3])
