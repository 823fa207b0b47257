"""Config of the EAGLE-3 draft: one decoder layer fed the fused target hidden states."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator
from transformers import LlamaConfig, PretrainedConfig

from speculators_vllm016.config import SpeculatorModelConfig
from speculators_vllm016.models.eagle3.mla_layout import (
    flat_mla_config,
    is_flat_mla_config,
    is_mla_layer_config,
    speculators_dict_from_flat_mla,
)
from speculators_vllm016.models.layer_config import transformer_layer_config_from

__all__ = ["Eagle3SpeculatorConfig"]


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
