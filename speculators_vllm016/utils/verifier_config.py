"""The verifier's config: as a config.json dict (one reader for the draft model, the converters, the
trainer and the CLI), as the config object vLLM 0.16 builds from it, and what is read from it
without building a config object."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from speculators_vllm016.utils.errors import InvalidInputError, first_line
from speculators_vllm016.utils.text_config import text_config_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "REMOTE_CODE_FLAG",
    "find_vocab_size",
    "load_verifier_config",
    "load_verifier_config_dict",
    "looks_local",
    "remote_code_hint",
]

REMOTE_CODE_FLAG = "--trust-remote-code"


def looks_local(model: str) -> bool:
    """A path, not a hub id ("org/name" or "name")."""
    return (
        os.path.isabs(model)
        or model.startswith((".", "~"))
        or model.count("/") > 1
        or os.sep != "/"
        and os.sep in model
    )


def remote_code_hint(error: BaseException, model: str) -> InvalidInputError | None:
    """A one-line error naming the flag when `error` is transformers/vLLM asking for remote code."""
    text = str(error)
    if "trust_remote_code" in text or "trust-remote-code" in text:
        return InvalidInputError(
            f"{model} needs the Python code shipped in its folder; pass {REMOTE_CODE_FLAG} if you "
            "trust it (off by default since 0.3.0 ran it unasked)"
        )
    return None


def load_verifier_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The verifier's config object as vLLM 0.16 builds it when it serves the model.

    vLLM has config classes of its own for models transformers does not know (`kimi_k25`,
    `deepseek_v32`, ...), so a target vLLM serves is read here even where transformers alone
    would need the folder's code. That code runs only with `trust_remote_code`, and only where
    neither library has a class for the model type. Errors are one-line `InvalidInputError`s.
    """
    local = Path(path).expanduser()
    if local.is_file():
        raise InvalidInputError(f"{path} is a file, not a model folder")
    if not local.exists() and looks_local(path):
        raise InvalidInputError(f"no model folder at {path}")
    try:
        from vllm.transformers_utils.config import get_config
    except ImportError:  # a training machine without vLLM (the trainer needs none)
        get_config = _transformers_config
    try:
        return get_config(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - any failure means: not a readable model config
        hint = remote_code_hint(error, path)
        if hint is not None:
            raise hint from None
        cause = (
            error.__cause__ if "Invalid repository ID" in str(error) and error.__cause__ else error
        )
        raise InvalidInputError(
            f"cannot read the model config of {path!r} ({first_line(cause)})"
        ) from None


def _transformers_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config transformers alone builds, where vLLM is not installed: the same for every
    model type transformers knows; a wrapper only vLLM has classes for (Kimi-K2.5) then needs
    its folder's code, and says so (`remote_code_hint`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_verifier_config_dict(base_model: str) -> dict:
    """The verifier's config.json as a dict, with an error that names the verifier."""
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(base_model)
    except Exception as err:
        raise InvalidInputError(
            f"cannot read the verifier config of {base_model!r}: {err}"
        ) from err
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
