"""Config of an independent draft: an ordinary small LM (e.g. a 1B Llama) used as the speculator.

Its config.json is the draft model's own config plus `speculators_config`, and keeps the
draft's `model_type` (e.g. "llama") so that transformers/vLLM can still build the model.
"""

from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr
from transformers import PretrainedConfig

from speculators_vllm016.config import SpeculatorModelConfig, SpeculatorsConfig

__all__ = ["IndependentSpeculatorConfig"]


@SpeculatorModelConfig.register("independent")
class IndependentSpeculatorConfig(SpeculatorModelConfig):
    """A standalone draft model described by its own transformers config."""

    speculators_model_type: str = "independent"
    _model_type: str | None = PrivateAttr(default=None)

    @classmethod
    def from_pretrained_config(
        cls, pretrained_config: PretrainedConfig, speculators_config: SpeculatorsConfig
    ) -> IndependentSpeculatorConfig:
        """Wrap a draft model's config, keeping all its fields and its model_type."""
        if not isinstance(pretrained_config, PretrainedConfig):
            raise TypeError(
                f"pretrained_config must be a PretrainedConfig, got {type(pretrained_config)}"
            )
        values = pretrained_config.to_dict()
        values["model_type"] = pretrained_config.model_type
        values.pop("speculators_model_type", None)
        return cls(**values, speculators_config=speculators_config)

    def __init__(self, **kwargs: Any) -> None:
        model_type = kwargs.pop("model_type", None)
        super().__init__(**kwargs)
        self._model_type = model_type

    def to_dict(self) -> dict[str, Any]:
        values = super().to_dict()
        values.pop("_model_type", None)
        if self._model_type is not None:
            values["model_type"] = self._model_type
        return values
