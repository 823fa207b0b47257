"""Config of the EAGLE-3 draft: one decoder layer fed the fused target hidden states."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator, model_serializer, model_validator
from transformers import LlamaConfig, PretrainedConfig

from speculators_vllm016.config import SpeculatorModelConfig
from speculators_vllm016.models.eagle3.mla_layout import (
    flat_mla_config,
    is_flat_mla_config,
    is_mla_layer_config,
    speculators_dict_from_flat_mla,
)
from speculators_vllm016.models.layer_config import transformer_layer_config_from
from speculators_vllm016.utils.eagle31 import EAGLE31_FIELDS
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["Eagle3SpeculatorConfig", "sliding_window_of"]

SLIDING = "sliding_attention"


def sliding_window_of(layer: PretrainedConfig) -> int | None:
    """The draft layers' sliding window, None for full attention.

    vLLM 0.16's `Eagle3LlamaForCausalLM` reads `layer_types` (indexed from the draft's own first
    layer) and `sliding_window`; this draft trains one window for all its layers, so a config
    that mixes layer types, or names a window it does not give, is refused.
    """
    kinds = getattr(layer, "layer_types", None)
    if not kinds or SLIDING not in kinds:
        return None
    window = getattr(layer, "sliding_window", None)
    if any(kind != SLIDING for kind in kinds) or not window or int(window) < 1:
        raise InvalidInputError(
            f"the draft's layer_types {list(kinds)} with sliding_window {window!r}: every layer "
            "sliding_attention with a window of at least 1 position, or no layer_types"
        )
    return int(window)


@SpeculatorModelConfig.register("eagle3")
class Eagle3SpeculatorConfig(SpeculatorModelConfig):
    speculators_model_type: Literal["eagle3"] = "eagle3"
    architectures: list[str] = Field(
        default_factory=lambda: ["Eagle3Speculator"],
        description="Classes that can load these weights.",
    )
    transformer_layer_config: PretrainedConfig = Field(
        default_factory=LlamaConfig, description="Config of the draft's decoder layer(s)."
    )
    draft_vocab_size: int = Field(default=32000, description="Tokens the draft can propose.")
    norm_before_residual: bool = Field(
        default=False, description="Normalize the fused hidden state before the residual add."
    )
    target_hidden_size: int | None = Field(
        default=None, description="Target model hidden size when it differs from the draft's."
    )
    eagle_aux_hidden_state_layer_ids: list[int] | None = Field(
        default=None,
        description=(
            "Target layers whose hidden states the draft fuses, as vLLM counts them: id i is the "
            "input of decoder layer i, i.e. the output of layer i - 1 that datagen captures as "
            "layer id i - 1."
        ),
    )

    norm_before_fc: bool = Field(
        default=False,
        description=(
            "One RMSNorm over the concatenated auxiliary states before `fc` (weight "
            "`input_norm.weight`); excludes `fc_norm`."
        ),
    )
    fc_norm: bool = Field(
        default=False,
        description=(
            "EAGLE-3.1: an RMSNorm per auxiliary state before the concatenation and `fc` "
            "(weights `fc_norm.<i>.weight`), so a late layer's larger activations do not drown "
            "the early ones in the fusion."
        ),
    )
    norm_output: bool = Field(
        default=False,
        description=(
            "EAGLE-3.1: each draft step hands the next one its hidden state after the final norm "
            "(the state the LM head reads) instead of before it, so the state's magnitude does "
            "not drift over the steps."
        ),
    )

    @model_validator(mode="after")
    def _one_fusion_norm(self) -> Eagle3SpeculatorConfig:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError(
                "norm_before_fc and fc_norm exclude each other: pick one norm before fc"
            )
        return self

    @model_serializer(mode="wrap")
    def _drop_unset_eagle31(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if isinstance(data, dict) and not any(data.get(name) for name in EAGLE31_FIELDS):
            for name in EAGLE31_FIELDS:
                data.pop(name, None)
        return data

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if not self.eagle31:
            for name in EAGLE31_FIELDS:
                data.pop(name, None)
        return data

    @property
    def eagle31(self) -> bool:
        """Whether any EAGLE-3.1 switch is on."""
        return any(getattr(self, name) for name in EAGLE31_FIELDS)

    @property
    def target_vocab_size(self) -> int:
        return self.transformer_layer_config.vocab_size

    @field_serializer("transformer_layer_config")
    def serialize_transformer_config(self, value: PretrainedConfig) -> dict:
        layer = value.to_diff_dict()
        # vLLM builds the draft's config from this dict alone: without a dtype in it, it asks the
        # hub for one (and waits) before assuming float32.
        outer = getattr(self, "torch_dtype", None) or getattr(self, "dtype", None)
        if outer is not None and "torch_dtype" not in layer and "dtype" not in layer:
            layer["torch_dtype"] = str(outer).removeprefix("torch.")
        return layer

    def to_json_string(self, use_diff: bool = True) -> str:
        """`config.json`'s text: the speculators layout, or for an MLA draft the flat layout
        vLLM >= 0.18 and TorchSpec read (`mla_layout`)."""
        if not is_mla_layer_config(self.transformer_layer_config):
            return super().to_json_string(use_diff)
        flat = flat_mla_config(self.transformer_layer_config.to_dict(), self.to_dict())
        return json.dumps(flat, indent=2, sort_keys=True) + "\n"

    @field_validator("transformer_layer_config", mode="before")
    @classmethod
    def validate_transformer_config(cls, value: Any) -> PretrainedConfig:
        return transformer_layer_config_from(value)


def _read_flat_mla(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    return speculators_dict_from_flat_mla(config_dict) if is_flat_mla_config(config_dict) else None


SpeculatorModelConfig.register_foreign_layout(_read_flat_mla)
