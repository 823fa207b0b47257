"""Sample files on disk: atomic writes, reading back, and what a resumed run still has to do.

A sample appears under its final name only once it is whole: it is written to a hidden temporary
file in the same directory, flushed to disk, and renamed. A crash (even SIGKILL) leaves at most a
temporary file, which the next run deletes.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch

__all__ = ["SAMPLE_PATTERNS", "load_sample", "remove_partial_files", "sample_path", "write_sample"]

SAMPLE_PATTERNS = {"pt": "data_{idx}.pt", "safetensors": "data_{idx}.safetensors"}
_SAMPLE_NAME = re.compile(r"^data_(\d+)\.(pt|safetensors)$")
_TEMP_PREFIX = ".tmp-"


def sample_path(output_dir: Path, index: int, output_format: str) -> Path:
    return output_dir / SAMPLE_PATTERNS[output_format].format(idx=index)


def _atomic_write(path: Path, write, fsync: bool) -> None:
    temp = path.with_name(f"{_TEMP_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            if fsync:  # survive power loss too, not only a crash of this process
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _independent_layers(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layers as tensors with their own storage (copied only if they share one)."""
    layers = [layer.contiguous() for layer in layers]
    storages = {layer.untyped_storage().data_ptr() for layer in layers}
    if len(storages) < len(layers):
        layers = [layer.clone() for layer in layers]
    return layers


def write_sample(
    path: Path, sample: dict[str, Any], output_format: str = "pt", fsync: bool = False
) -> int:
    """Write one sample atomically in the 0.3.0 layout (or as safetensors); return its bytes.

    The file appears under its name only when whole (temporary file + rename), which holds
    through a crash or SIGKILL of this process; `fsync=True` also makes it survive power loss.
    `hidden_states` are stored as independent tensors, one per captured layer.
    """
    input_ids = torch.as_tensor(sample["input_ids"], dtype=torch.long).contiguous()
    loss_mask = torch.as_tensor(sample["loss_mask"], dtype=torch.long).contiguous()
    hidden_states = _independent_layers(list(sample["hidden_states"]))
    if output_format == "pt":
        payload = {"input_ids": input_ids, "hidden_states": hidden_states, "loss_mask": loss_mask}
        _atomic_write(path, lambda handle: torch.save(payload, handle), fsync)
    elif output_format == "safetensors":
        from safetensors.torch import save

        tensors = {"input_ids": input_ids, "loss_mask": loss_mask}
        tensors.update({f"hidden_states.{i}": layer for i, layer in enumerate(hidden_states)})
        blob = save(tensors, metadata={"num_hidden_states": str(len(hidden_states))})
        _atomic_write(path, lambda handle: handle.write(blob), fsync)
    else:
        raise ValueError(f"unknown output format {output_format!r}; use 'pt' or 'safetensors'")
    return path.stat().st_size


def load_sample(path: str | os.PathLike, mmap: bool = True) -> dict[str, Any]:
    """Read a sample file of either format into the 0.3.0 dict layout."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        count = sum(1 for name in tensors if name.startswith("hidden_states."))
        return {
            "input_ids": tensors["input_ids"],
            "hidden_states": [tensors[f"hidden_states.{i}"] for i in range(count)],
            "loss_mask": tensors["loss_mask"],
        }
    return torch.load(path, weights_only=True, mmap=mmap)


def existing_sample_indices(output_dir: Path, output_format: str) -> set[int]:
    """Indices of whole sample files of the given format in `output_dir`."""
    if not output_dir.is_dir():
        return set()
    suffix = "pt" if output_format == "pt" else "safetensors"
    found = set()
    for entry in os.scandir(output_dir):
        match = _SAMPLE_NAME.match(entry.name)
        if match and match.group(2) == suffix:
            found.add(int(match.group(1)))
    return found


def remove_partial_files(output_dir: Path) -> int:
    """Delete temporary files a crashed run left behind; return how many."""
    if not output_dir.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(output_dir):
        if entry.name.startswith(_TEMP_PREFIX):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    return removed
