"""The verifier's config.json as a dict: one reader for the draft model, the converters and the CLI."""

from __future__ import annotations

__all__ = ["load_verifier_config_dict"]


def load_verifier_config_dict(base_model: str) -> dict:
    """The verifier's config.json as a dict, with an error that names the verifier."""
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(base_model)
    except Exception as err:
        raise ValueError(f"cannot read the verifier config of {base_model!r}: {err}") from err
    return config_dict
