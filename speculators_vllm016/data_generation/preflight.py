"""What can be known about a datagen run from `config.json` and the flags, before any work.

Each check fails with an `InvalidInputError` (a `ValueError`) whose one line names the problem and the fix, so a typo
costs seconds instead of a preprocessing pass and an engine start, and nothing is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.layer_ids import default_layer_ids, normalize_layer_ids
from speculators_vllm016.utils.text_config import text_config_of
from speculators_vllm016.utils.verifier_config import REMOTE_CODE_FLAG, looks_local

__all__ = ["ModelFacts", "inspect_model"]


@dataclass(frozen=True)
class ModelFacts:
    path: str  # local folders resolved to an absolute path; hub ids as given
    num_layers: int
    hidden_size: int
    layer_ids: list[int]  # resolved: defaults filled in, negative ids counted from the end
    config_dict: dict


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _read_config(model: str) -> dict:
    local = Path(model).expanduser()
    if local.is_dir():
        config = local / "config.json"
        if not config.is_file():
            raise InvalidInputError(
                f"{local} has no config.json; point --target-model-path at a model folder"
            )
        try:
            return json.loads(config.read_text())
        except ValueError as error:
            raise InvalidInputError(
                f"{config} is not valid JSON ({error}); fix or replace it"
            ) from None
    if local.exists():
        raise InvalidInputError(
            f"{local} is a file; --target-model-path needs a model folder or hub id"
        )
    if looks_local(model) or _offline():
        raise InvalidInputError(
            f"no model folder at {model}; check --target-model-path (a local folder, or a hub "
            "id like org/name when online)"
        )
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(model)
    except Exception as error:  # noqa: BLE001 - hub errors come in many types
        raise InvalidInputError(
            f"cannot read the config of {model!r} from the hub ({type(error).__name__}); check "
            "the id, your network and your token, or pass a local folder"
        ) from None
    return config_dict


def _known_model_type(model_type: str) -> bool:
    """A config class for `model_type` exists without the model folder's code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return True
    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:
        return False
    return model_type in _CONFIG_REGISTRY


def needs_remote_code(config_dict: dict) -> bool:
    """The config can only be built by code shipped in the model folder."""
    auto_map = config_dict.get("auto_map") or {}
    model_type = config_dict.get("model_type")
    return "AutoConfig" in auto_map and not (model_type and _known_model_type(model_type))


def inspect_model(
    model: str,
    layer_ids: list[int] | None,
    trust_remote_code: bool = False,
    config_dict: dict | None = None,
) -> ModelFacts:
    """Read the model's config (no code from the model folder runs) and resolve the layers.
    `config_dict`: its config.json where the caller read it already (not read again)."""
    if config_dict is None:
        config_dict = _read_config(model)
    if not trust_remote_code and needs_remote_code(config_dict):
        raise InvalidInputError(
            f"{model} needs the Python code shipped in its folder (its config names "
            f"{config_dict['auto_map']['AutoConfig']}); pass {REMOTE_CODE_FLAG} if you trust it "
            "(off by default since 0.3.0 ran it unasked)"
        )
    text = text_config_of(config_dict)
    num_layers = text.get("num_hidden_layers")
    hidden_size = text.get("hidden_size")
    if not isinstance(num_layers, int) or num_layers < 1 or not isinstance(hidden_size, int):
        raise InvalidInputError(
            f"the config of {model} has no usable num_hidden_layers/hidden_size; is it a "
            "decoder language model?"
        )
    try:
        resolved = normalize_layer_ids(
            default_layer_ids(num_layers) if layer_ids is None else list(layer_ids), num_layers
        )
    except ValueError as error:
        raise InvalidInputError(f"--layer-ids: {error}") from None
    local = Path(model).expanduser()
    path = str(local.resolve()) if local.is_dir() else model
    return ModelFacts(path, num_layers, hidden_size, resolved, config_dict)
