"""One parser for `transformer_layer_config` in EAGLE and EAGLE-3 configs (issue 12, seams)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import LlamaConfig, Qwen3Config

from speculators_vllm016.models.eagle import EagleSpeculatorConfig
from speculators_vllm016.models.eagle3 import Eagle3SpeculatorConfig

CONFIG_CLASSES = [EagleSpeculatorConfig, Eagle3SpeculatorConfig]


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_both_configs_read_the_layer_config_alike(config_class) -> None:
    plain = config_class(transformer_layer_config={"hidden_size": 64})
    assert type(plain.transformer_layer_config) is LlamaConfig
    assert plain.transformer_layer_config.hidden_size == 64
    typed = config_class(transformer_layer_config={"model_type": "qwen3", "hidden_size": 32})
    assert type(typed.transformer_layer_config) is Qwen3Config
    assert typed.transformer_layer_config.hidden_size == 32
    given = LlamaConfig(hidden_size=16)
    assert config_class(transformer_layer_config=given).transformer_layer_config is given


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "value, message",
    [
        ({"model_type": "no-such-model"}, "unknown model_type 'no-such-model'"),
        (3, "PretrainedConfig or a dict"),
        ("llama", "PretrainedConfig or a dict"),
    ],
)
def test_both_configs_refuse_alike(config_class, value, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config_class(transformer_layer_config=value)
