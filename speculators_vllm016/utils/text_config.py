"""Where a model config keeps its text model's settings: the one lookup for that."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["text_config_of"]


def text_config_of(config: Any) -> Any:
    """The text model's part of a config: its `text_config` if it has one, else the config.

    Multimodal wrappers (Kimi-K2.5, Llava, ...) nest the language model's settings (layers,
    vocabulary, attention type) under `text_config`; plain models keep them at the top. Takes a
    `config.json` dict or a transformers config object and returns the same kind.
    """
    if isinstance(config, Mapping):
        nested = config.get("text_config")
        return nested if isinstance(nested, Mapping) and nested else config
    nested = getattr(config, "text_config", None)
    return nested if nested is not None else config
