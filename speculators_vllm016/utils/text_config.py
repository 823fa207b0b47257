"""Where a model config keeps its text model's settings: the one lookup for that."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NESTED_TEXT_CONFIG_KEYS", "text_config_of"]

# Keys under which multimodal wrappers nest their language model's config, in the order tried.
NESTED_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


def text_config_of(config: Any) -> Any:
    """The text model's part of a config: its nested text config if it has one, else the config.

    Multimodal wrappers (Kimi-K2.5, Llava, InternVL, ...) nest the language model's settings
    (layers, vocabulary, attention type) under `text_config` (or `language_config`,
    `llm_config`); plain models keep them at the top. Takes a `config.json` dict or a
    transformers config object and returns the same kind.
    """
    if isinstance(config, Mapping):
        for key in NESTED_TEXT_CONFIG_KEYS:
            nested = config.get(key)
            if isinstance(nested, Mapping) and nested:
                return nested
        return config
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        return get_text_config()
    for key in NESTED_TEXT_CONFIG_KEYS:
        nested = getattr(config, key, None)
        if nested is not None:
            return nested
    return config
