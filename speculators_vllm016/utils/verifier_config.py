"""The verifier's config.json as a dict (one reader for the draft model, the converters, the trainer
and the CLI), and what is read from it without building a config object."""

from __future__ import annotations

from speculators_vllm016.utils.text_config import text_config_of

__all__ = ["find_vocab_size", "load_verifier_config_dict"]


def load_verifier_config_dict(base_model: str) -> dict:
    """The verifier's config.json as a dict, with an error that names the verifier."""
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(base_model)
    except Exception as err:
        raise ValueError(f"cannot read the verifier config of {base_model!r}: {err}") from err
    return config_dict


def find_vocab_size(config_dict: dict) -> int | None:
    """`vocab_size` of the text model (`text_config` or the top level), else of any nested dict."""
    if not isinstance(config_dict, dict):
        return None
    text = text_config_of(config_dict)
    if "vocab_size" in text:
        return text["vocab_size"]
    for value in config_dict.values():
        found = find_vocab_size(value) if isinstance(value, dict) else None
        if found is not None:
            return found
    return None
