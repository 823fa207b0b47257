"""Layer discovery and residual-stream reading, on module trees shaped like the real models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speculators_vllm016.data_generation.layer_capture import (
    UnsupportedModelError,
    find_decoder_layers,
    residual_scale,
    residual_stream,
)


class PPMissingLayer(nn.Identity):
    """Same name as vLLM's placeholder for layers owned by another pipeline stage."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def causal_lm(num_layers: int) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(8, 4)
    model.model.layers = nn.ModuleList(Block() for _ in range(num_layers))
    model.lm_head = nn.Linear(4, 8)
    return model


def test_finds_llama_style_layers():
    found = find_decoder_layers(causal_lm(5), 5)
    assert found.path == "model.layers"
    assert found.owned == (0, 1, 2, 3, 4)


def test_finds_layers_nested_in_a_multimodal_wrapper_and_ignores_the_vision_tower():
    wrapper = nn.Module()
    wrapper.vision_tower = nn.Module()
    wrapper.vision_tower.layers = nn.ModuleList(Block() for _ in range(3))
    wrapper.language_model = causal_lm(3)
    found = find_decoder_layers(wrapper, 3)
    assert found.path == "language_model.model.layers"


def test_pipeline_placeholders_are_not_owned():
    model = causal_lm(4)
    model.model.layers[0] = PPMissingLayer()
    model.model.layers[1] = PPMissingLayer()
    assert find_decoder_layers(model, 4).owned == (2, 3)


def test_error_names_the_model_class_and_what_is_missing():
    model = causal_lm(2)
    with pytest.raises(
        UnsupportedModelError,
        match=r"Module.*no module list.*6 decoder layers.*model\.layers \(2\)",
    ):
        find_decoder_layers(model, 6)


def test_residual_stream_sums_the_deferred_residual():
    hidden, residual = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(residual_stream((hidden, residual)), hidden + residual)
    assert torch.equal(residual_stream((hidden, None)), hidden)
    assert torch.equal(residual_stream(hidden), hidden)
    with pytest.raises(UnsupportedModelError, match="dict"):
        residual_stream({"hidden_states": hidden})


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.routed_scaling_factor = 2.5
        self.self_attn = nn.Identity()


def test_deepseek_fp16_stream_is_scaled_back():
    layer = DeepseekV2DecoderLayer()
    assert residual_scale(layer, torch.float16) == 2.5
    assert residual_scale(layer, torch.bfloat16) == 1.0
    assert residual_scale(Block(), torch.float16) == 1.0
