"""Reading research checkpoints: find them locally or on the hub, load config and weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "detect_fusion_bias_and_layernorms",
    "download_checkpoint_from_hub",
    "ensure_checkpoint_is_local",
    "find_vocab_size",
    "load_checkpoint_config",
    "load_checkpoint_weights",
]

logger = logging.getLogger(__name__)

# Weight names whose presence marks a HASS-style checkpoint with extra norms.
LAYERNORM_MARKERS = ("embed_layernorm.weight", "post_embedding_layernorm.weight")


def find_vocab_size(config_dict: dict) -> int | None:
    """`vocab_size` at the top of a config dict or in any nested dict (e.g. `text_config`)."""
    if not isinstance(config_dict, dict):
        return None
    if "vocab_size" in config_dict:
        return config_dict["vocab_size"]
    for value in config_dict.values():
        found = find_vocab_size(value) if isinstance(value, dict) else None
        if found is not None:
            return found
    return None


def download_checkpoint_from_hub(model_id: str, cache_dir: str | None = None) -> Path:
    """Fetch only configs and weights of a hub repo; returns the local snapshot folder."""
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from the Hugging Face hub", model_id)
    try:
        path = snapshot_download(
            repo_id=model_id,
            allow_patterns=["*.json", "*.safetensors", "*.bin"],
            cache_dir=cache_dir,
        )
    except Exception as err:
        raise FileNotFoundError(
            f"checkpoint {model_id!r} is neither a local folder nor downloadable: {err}"
        ) from err
    return Path(path)


def ensure_checkpoint_is_local(
    checkpoint_path: str | Path, cache_dir: str | Path | None = None
) -> Path:
    """A local folder as is; anything else is taken for a hub id and downloaded."""
    path = Path(checkpoint_path)
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"checkpoint {path} must be a folder, not a file")
        return path
    return download_checkpoint_from_hub(
        str(checkpoint_path), cache_dir=str(cache_dir) if cache_dir else None
    )


def load_checkpoint_config(checkpoint_dir: Path) -> dict:
    """The checkpoint's config.json as a dict."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {checkpoint_dir}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def _state_dict_from(obj: Any, source: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise ValueError(f"{source} does not hold a flat name -> tensor state dict")
    return obj


def load_checkpoint_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or pytorch_model.bin (single file; shards refused)."""
    checkpoint_dir = Path(checkpoint_dir)
    safetensors_path = checkpoint_dir / "model.safetensors"
    if safetensors_path.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_path), device="cpu")
        except Exception as err:  # noqa: BLE001 - a damaged file fails in many ways
            raise ValueError(
                f"{safetensors_path} is not a readable safetensors file ({type(err).__name__}); "
                "download or copy it again"
            ) from err
    bin_path = checkpoint_dir / "pytorch_model.bin"
    if bin_path.is_file():
        try:
            # weights_only: a checkpoint is data; refuse pickled code.
            loaded = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged file fails in many ways
            raise ValueError(
                f"{bin_path} is not a readable PyTorch checkpoint ({type(err).__name__}); "
                "download or copy it again"
            ) from err
        return _state_dict_from(loaded, bin_path)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (checkpoint_dir / index).is_file():
            raise NotImplementedError(
                f"sharded checkpoint ({index}) in {checkpoint_dir}; merge it into one file first"
            )
    raise FileNotFoundError(
        f"no model.safetensors or pytorch_model.bin in {checkpoint_dir}"
    )


def detect_fusion_bias_and_layernorms(weights: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    """(has fusion bias, has extra layernorms), judged by the weight names of a HASS checkpoint."""
    has_bias = "fc.bias" in weights
    has_norms = any(name in weights for name in LAYERNORM_MARKERS)
    if has_bias:
        logger.info("checkpoint has a fusion bias (fc.bias)")
    if has_norms:
        logger.info("checkpoint has extra layernorms")
    return has_bias, has_norms


def loaded_on(model: torch.nn.Module, device: str) -> dict[str, torch.Tensor]:
    """The model's loaded tensors placed on `device` (refused early if the device is unusable).

    Tensors left on the meta device (parts a checkpoint does not carry) are skipped.
    """
    try:
        target = torch.device(device)
        return {
            name: tensor.to(target)
            for name, tensor in model.state_dict().items()
            if not tensor.is_meta
        }
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"cannot validate on --validate-device {device!r}: {err}") from err


def load_verifier_config_dict(base_model: str) -> dict:
    """The verifier's config.json as a dict, with an error that names the verifier."""
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(base_model)
    except Exception as err:
        raise ValueError(f"cannot read the verifier config of {base_model!r}: {err}") from err
    return config_dict
