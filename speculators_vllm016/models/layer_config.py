"""The `transformer_layer_config` field of draft configs: one parser for EAGLE and EAGLE-3."""

from __future__ import annotations

from typing import Any

from transformers import CONFIG_MAPPING, LlamaConfig, PretrainedConfig

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["transformer_layer_config_from"]


def transformer_layer_config_from(value: Any) -> PretrainedConfig:
    """A transformers config from a config or a dict (typed by its `model_type`, else Llama).

    Raises ValueError (which pydantic reports as a validation error of the field) for anything
    else and for a `model_type` transformers does not know.
    """
    if isinstance(value, PretrainedConfig):
        return value
    if not isinstance(value, dict):
        raise InvalidInputError(
            "transformer_layer_config must be a transformers PretrainedConfig or a dict of one, "
            f"got {type(value).__name__}"
        )
    values = dict(value)
    model_type = values.pop("model_type", None)
    if not model_type:
        return LlamaConfig(**values)
    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        raise InvalidInputError(
            f"transformer_layer_config has unknown model_type {model_type!r}; use a model type "
            "transformers knows, e.g. 'llama'"
        ) from None
    return config_class(**values)
