"""The one checkpoint reader: named (or all) tensors of a Hugging Face style weights folder.

Reads safetensors (one file or shards with `model.safetensors.index.json`) and PyTorch `.bin`
files (one file or shards with `pytorch_model.bin.index.json`, loaded with `weights_only`). A
path that is not a local folder is taken for a hub repo id, and only the files holding the wanted
tensors are downloaded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators_vllm016.utils.errors import InvalidInputError, first_line

__all__ = [
    "CheckpointListing",
    "checkpoint_tensor_names",
    "list_checkpoint",
    "load_model_layers",
    "read_checkpoint_tensors",
    "read_weights_file",
]

logger = logging.getLogger(__name__)

# (index file, single file) per format, in the order they are tried.
_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)


def _resolve_file(
    model_path: str | Path, file_name: str, cache_dir: str | Path | None = None
) -> Path | None:
    """`file_name` in the local folder, or downloaded from the hub repo; None when absent.

    Called as 0.3.0 called it (`_resolve_file(repo, name)`); unlike 0.3.0 an absent file is
    None, not an error, so that callers can try the next layout.
    """
    folder = Path(model_path)
    if folder.is_dir():
        candidate = folder / file_name
        return candidate if candidate.is_file() else None
    # Looked up at call time, so that patching huggingface_hub.hf_hub_download takes effect.
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(
            hf_hub_download(
                repo_id=str(model_path),
                filename=file_name,
                cache_dir=str(cache_dir) if cache_dir is not None else None,
            )
        )
    except EntryNotFoundError:
        return None


def _no_weights(model_path: str | Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"no weights in {model_path}: expected model.safetensors, pytorch_model.bin or a sharded "
        "index of either"
    )


def read_weights_file(
    path: Path, names: set[str] | None = None, *, open_safetensors: Callable[..., Any] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors called `names` (all when None) of one .safetensors or PyTorch .bin file.

    `open_safetensors` stands in for `safetensors.safe_open` (the EAGLE converter passes the
    name 0.3.0 code patches). A .bin is read with `weights_only`.
    """
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        opener = open_safetensors or safe_open
        try:
            with opener(str(path), framework="pt", device="cpu") as handle:
                keys = list(handle.keys())
                wanted = keys if names is None else [n for n in keys if n in names]
                return {name: handle.get_tensor(name) for name in wanted}
        except SafetensorError as err:
            raise InvalidInputError(f"{path} is not a readable safetensors file: {err}") from err
    try:
        # weights_only: a checkpoint is data; refuse pickled code.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise InvalidInputError(
            f"{path} is not a readable PyTorch checkpoint ({first_line(err)}); "
            "re-save it or convert it to safetensors"
        ) from err
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise InvalidInputError(f"{path} does not hold a flat name -> tensor state dict")
    return {k: v for k, v in state.items() if names is None or k in names}


def _weights_location(
    model_path: str | Path, cache_dir: str | Path | None
) -> tuple[Path, dict[str, str] | None]:
    """The checkpoint's index file and its weight map, or its single weights file and None."""
    for index_name, single_name in _LAYOUTS:
        index = _resolve_file(model_path, index_name, cache_dir)
        if index is not None:
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InvalidInputError(f"{index} has no weight_map: re-save the checkpoint")
            return index, weight_map
        single = _resolve_file(model_path, single_name, cache_dir)
        if single is not None:
            return single, None
    raise _no_weights(model_path)


@dataclass(frozen=True)
class CheckpointListing:
    """Where a checkpoint keeps its tensors and what they are called, found once: a job that
    reads some of its tensors later reads them from here, without opening its index or its
    safetensors header again (on a network filesystem, or for a hub checkpoint, every pass
    over a 1T-parameter model's index costs)."""

    model_path: str
    location: Path
    """Its index file, or its single weights file."""
    weight_map: dict[str, str] | None
    """The index's tensor name -> shard file; None for a single weights file."""
    names: tuple[str, ...]
    """Every tensor it holds, sorted."""
    cache_dir: str | Path | None = None

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors called `names` that it holds (the others are left out)."""
        return _read_located(
            self.model_path, self.location, self.weight_map, set(names), self.cache_dir
        )


def list_checkpoint(
    model_path: str | Path, *, cache_dir: str | Path | None = None
) -> CheckpointListing:
    """The checkpoint's `CheckpointListing`: its index, or its safetensors header, read once (no
    tensor data is read; a single PyTorch .bin is memory-mapped)."""
    location, weight_map = _weights_location(model_path, cache_dir)
    return CheckpointListing(
        str(model_path),
        location,
        weight_map,
        tuple(_tensor_names(location, weight_map)),
        cache_dir,
    )


def read_checkpoint_tensors(
    model_path: str | Path,
    names: Iterable[str] | None = None,
    *,
    cache_dir: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors called `names` (all tensors when None) that the checkpoint holds.

    Names the checkpoint lacks are left out. Raises FileNotFoundError when there are no weights.
    """
    wanted = None if names is None else set(names)
    location, weight_map = _weights_location(model_path, cache_dir)
    return _read_located(model_path, location, weight_map, wanted, cache_dir)


def _read_located(
    model_path: str | Path,
    location: Path,
    weight_map: dict[str, str] | None,
    wanted: set[str] | None,
    cache_dir: str | Path | None,
) -> dict[str, torch.Tensor]:
    """`read_checkpoint_tensors` once the index (or the single file) is known."""
    if weight_map is None:
        return read_weights_file(location, wanted)
    files = sorted(
        {shard for name, shard in weight_map.items() if wanted is None or name in wanted}
    )
    found: dict[str, torch.Tensor] = {}
    for shard in files:
        shard_path = _resolve_file(model_path, shard, cache_dir)
        if shard_path is None:
            raise FileNotFoundError(
                f"{model_path}: {location.name} names {shard}, which is missing"
            )
        found.update(read_weights_file(shard_path, wanted))
    return found


def checkpoint_tensor_names(
    model_path: str | Path, *, cache_dir: str | Path | None = None
) -> list[str]:
    """The names of every tensor the checkpoint holds, read from its index or safetensors header
    (no tensor data is read; a single PyTorch .bin is memory-mapped)."""
    return list(list_checkpoint(model_path, cache_dir=cache_dir).names)


def _tensor_names(location: Path, weight_map: dict[str, str] | None) -> list[str]:
    """`checkpoint_tensor_names` once the index (or the single file) is known."""
    if weight_map is not None:
        return sorted(weight_map)
    if location.suffix != ".safetensors":
        return sorted(read_weights_file(location))
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(location), framework="pt", device="cpu") as handle:
            return sorted(handle.keys())
    except SafetensorError as err:
        raise InvalidInputError(f"{location} is not a readable safetensors file: {err}") from err


def load_model_layers(
    layer_names: list[str], model_path: str, *, cache_dir: str | Path | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of `layer_names` that the checkpoint has (missing names are left out).

    Raises ValueError when it has none of them. Reads (and downloads) only the files that hold
    them.
    """
    found = read_checkpoint_tensors(model_path, layer_names, cache_dir=cache_dir)
    if not found:
        raise InvalidInputError(f"{model_path} holds none of the tensors {sorted(layer_names)}")
    lacking = sorted(set(layer_names) - set(found))
    if lacking:
        logger.debug("%s has no %s", model_path, lacking)
    return found
