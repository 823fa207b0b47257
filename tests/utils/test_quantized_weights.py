"""When a checkpoint stores a module quantized: by its tensors, and by a compressed-tensors config."""

from __future__ import annotations

import pytest

from speculators_vllm016.utils.quantized_weights import (
    config_quantizes,
    quantization_config_of,
    quantized_storage,
)

INT4 = {
    "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}},
    "ignore": ["lm_head", r"re:.*self_attn.*"],
}


@pytest.mark.parametrize(
    ("module", "module_class", "quantized"),
    [
        ("language_model.lm_head", "Linear", False),  # ignored by the text model's name
        ("lm_head", "Linear", False),
        ("language_model.model.layers.0.self_attn.q_proj", "Linear", False),  # ignored by regex
        ("language_model.model.layers.1.mlp.experts.0.up_proj", "Linear", True),
        ("language_model.model.embed_tokens", "Embedding", False),  # not a target
        ("language_model.model.norm", None, False),
    ],
)
def test_compressed_tensors_targets_and_ignore_list(module, module_class, quantized):
    assert config_quantizes(INT4, module, module_class) is quantized


def test_a_head_left_out_of_the_ignore_list_or_targeted_by_name_is_quantized():
    assert config_quantizes({**INT4, "ignore": []}, "language_model.lm_head", "Linear")
    by_name = {
        **INT4,
        "ignore": [],
        "config_groups": {"g": {"targets": ["re:.*embed_tokens$"], "weights": {}}},
    }
    assert config_quantizes(by_name, "model.embed_tokens", "Embedding")
    assert not config_quantizes({"quant_method": "fp8"}, "lm_head", "Linear")  # judged by tensors
    assert not config_quantizes(None, "lm_head", "Linear")


def test_quantization_tensors_and_where_the_config_keeps_them():
    names = [
        "lm_head.weight_packed",
        "lm_head.weight_scale",
        "lm_head.weight_shape",
        "model.norm.weight",
    ]
    assert quantized_storage("lm_head", names) == ["weight_packed", "weight_scale", "weight_shape"]
    assert quantized_storage("model.norm", names) == []
    assert quantized_storage("fp8", ["fp8.weight", "fp8.weight_scale_inv"]) == ["weight_scale_inv"]
    assert quantization_config_of({"text_config": {"quantization_config": INT4}}) is INT4
    assert quantization_config_of({"quantization_config": INT4, "text_config": {}}) is INT4
    assert quantization_config_of({"text_config": {}}) is None
