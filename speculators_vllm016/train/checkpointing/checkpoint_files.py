"""Writing and reading a checkpoint's files so that their failures say what happened.

torch's zip writer swallows the `OSError` of a full disk and fails with "unexpected pos" instead;
`utils.atomic_files.torch_save` keeps the real error, and `is_disk_full`
recognises it (or safetensors' message of it). `reading` turns the zip, header or pickle error of a
damaged file into one line that names the file and its checkpoint and says how to go on from the
checkpoint before it; a file that holds more than tensors and plain values (a planted pickle) is
refused as such, never loaded with code execution.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from safetensors import safe_open

from speculators_vllm016.train.errors import CheckpointReadError
from speculators_vllm016.utils.atomic_files import fsync_folder
from speculators_vllm016.utils.errors import type_and_first_line

__all__ = [
    "convert_float_dtype",
    "fsync_files",
    "is_disk_full",
    "load_safetensors_state_dict",
    "reading",
    "weights_only_refusal",
]

_NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device": what Rust's errors quote


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it came from, is a full disk (or quota)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if _NO_SPACE in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def weights_only_refusal(error: BaseException) -> str | None:
    """The one telling line of torch's long refusal to load a file with `weights_only=True`
    (what the file would need to run), or None when `error` is no such refusal."""
    for line in str(error).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0]
    return None


@contextlib.contextmanager
def reading(path: Path, checkpoint: Path, previous: Path | None) -> Iterator[None]:
    """Report a failure to read `path` of `checkpoint` as a damaged file, with the way on."""
    try:
        yield
    except CheckpointReadError:
        raise
    except Exception as error:  # noqa: BLE001 - zip, header, pickle: the file is damaged
        if previous is not None:
            how = (
                f"move {checkpoint} out of the save folder and run the same command again to "
                f"resume from {previous.name}"
            )
        else:
            how = (
                f"it is the only checkpoint: move {checkpoint} away (or use "
                "--no-resume-from-checkpoint) to start from scratch"
            )
        refusal = weights_only_refusal(error)
        if refusal is not None:
            raise CheckpointReadError(
                f"{path.name} of checkpoint {checkpoint} holds more than tensors and plain values: "
                f"loading it would run code from the file ({refusal}), so it is refused; {how}"
            ) from None
        raise CheckpointReadError(
            f"{path.name} of checkpoint {checkpoint} cannot be read ({type_and_first_line(error)}): "
            f"the file is damaged (cut short by a full disk or a copy?); {how}"
        ) from error


def convert_float_dtype(sd: pytree.PyTree, dtype: torch.dtype) -> pytree.PyTree:
    """Cast every floating-point tensor in a nested structure to `dtype`."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return pytree.tree_map(cast, sd)


def load_safetensors_state_dict(path: Path, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on `device`."""
    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def fsync_files(folder: Path) -> None:
    """Flush every file of a checkpoint folder and the folder itself before it is renamed."""
    for entry in folder.iterdir():
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_folder(folder)
