"""Reading research checkpoints: find them locally or on the hub, load config and weights."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open

from speculators_vllm016.utils.errors import InvalidInputError, first_line
from speculators_vllm016.utils.loading import read_checkpoint_tensors, read_weights_file
from speculators_vllm016.utils.verifier_config import find_vocab_size

__all__ = [
    "detect_fusion_bias_and_layernorms",
    "download_checkpoint_from_hub",
    "ensure_checkpoint_is_local",
    "find_vocab_size",
    "load_checkpoint_config",
    "load_checkpoint_weights",
    "read_research_checkpoint",
    "ResearchCheckpoint",
]

logger = logging.getLogger(__name__)

# Weight names whose presence marks a HASS-style checkpoint with extra norms.
LAYERNORM_MARKERS = ("embed_layernorm.weight", "post_embedding_layernorm.weight")
# What a hub download fetches: configs (the shard indexes included) and weights, as in 0.3.0.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.index.json"]
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def download_checkpoint_from_hub(model_id: str, cache_dir: str | None = None) -> Path:
    """Fetch only configs and weights of a hub repo; returns the local snapshot folder.

    `snapshot_download` is looked up in this module when called, so code that patches
    `speculators.convert.eagle.utils.snapshot_download` (as 0.3.0's tests do) is served.
    """
    logger.info("downloading %s from the Hugging Face hub", model_id)
    try:
        path = snapshot_download(
            repo_id=model_id, allow_patterns=DOWNLOAD_PATTERNS, cache_dir=cache_dir
        )
    except Exception as err:
        raise FileNotFoundError(
            f"Checkpoint not found: {model_id}. It is neither a local folder nor downloadable: "
            f"{first_line(err)}"
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
        model_id=str(checkpoint_path), cache_dir=str(cache_dir) if cache_dir else None
    )


def load_checkpoint_config(checkpoint_dir: Path) -> dict:
    """The checkpoint's config.json as a dict."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"No config.json found at {checkpoint_dir}. A research checkpoint folder holds its "
            "config.json next to its weights"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:  # the type 0.3.0 raised, with the file named
        raise json.JSONDecodeError(
            f"{path} is not valid JSON: {err.msg}", err.doc, err.pos
        ) from err
    if not isinstance(config, dict):
        raise InvalidInputError(f"{path} must hold a JSON object")
    return config


def load_checkpoint_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's weights.

    As in 0.3.0: model.safetensors first, else pytorch_model.bin, read through this module's
    `safe_open` and `torch.load` (names that callers patch; `torch` is the one torch module).
    Unlike 0.3.0, a .bin is read with `weights_only=True` (a checkpoint is data; pickled code is
    refused), and a sharded checkpoint (only an index and its shards) is read, not refused.
    """
    folder = Path(checkpoint_dir)
    for single in (folder / "model.safetensors", folder / "pytorch_model.bin"):
        if single.exists():
            logger.debug("reading %s", single)
            return read_weights_file(single, open_safetensors=safe_open)
    if any((folder / index).exists() for index in SHARD_INDEXES):
        return read_checkpoint_tensors(folder)
    raise FileNotFoundError(
        f"No weights found at {folder}. Expected model.safetensors, pytorch_model.bin or a "
        "sharded index of either"
    )


def detect_fusion_bias_and_layernorms(weights: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    """(has fusion bias, has extra layernorms), judged by the weight names of a HASS checkpoint."""
    has_bias = "fc.bias" in weights
    has_norms = any(name in weights for name in LAYERNORM_MARKERS)
    # One-argument calls with 0.3.0's sentences: code that mocks `logger` checks them.
    if has_bias:
        logger.info("Detected fusion bias in checkpoint")
    if has_norms:
        logger.info("Detected extra layernorms in checkpoint")
    return has_bias, has_norms


@dataclass
class ResearchCheckpoint:
    """A research checkpoint as both converters start from it."""

    config: dict
    """Its config.json."""
    weights: dict[str, torch.Tensor]
    """All its tensors, under their research names."""


def read_research_checkpoint(
    input_path: str | Path, cache_dir: str | Path | None = None
) -> ResearchCheckpoint:
    """The config and weights of a local folder or hub id (downloaded into `cache_dir`)."""
    local = ensure_checkpoint_is_local(input_path, cache_dir)
    config = load_checkpoint_config(local)
    # A speculators folder (what convert and train write) has no research layout to read: say so
    # rather than fail on the first research key it lacks.
    if "speculators_config" in config or "speculators_model_type" in config:
        raise InvalidInputError(
            f"{input_path} is already in the speculators format (its config.json has "
            "speculators_config): nothing to convert; serve it with vLLM or evaluate it as it is"
        )
    return ResearchCheckpoint(config=config, weights=load_checkpoint_weights(local))
