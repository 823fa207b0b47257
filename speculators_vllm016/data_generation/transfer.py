"""Shared-memory files that carry captured hidden states from the workers to the driver.

Each request gets one file `[num_layers, seq_len, hidden_size]` in the model dtype, created by the
driver before the request is scheduled. The worker maps it and writes rows as the prefill chunks
run; the driver maps it when the request has finished and unlinks it at once, so the tensors it
returns are backed by memory that disappears with them. Nothing bulky crosses vLLM's RPC queue.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

__all__ = [
    "TRANSFER_ROOT_ENV",
    "TransferDir",
    "check_transfer_space",
    "default_transfer_root",
    "map_shared",
    "resolve_transfer_root",
]

_SHM = Path("/dev/shm")


TRANSFER_ROOT_ENV = "SPECULATORS_TRANSFER_ROOT"
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def resolve_transfer_root(root: str | os.PathLike | None = None) -> Path:
    """The flag's value, else $SPECULATORS_TRANSFER_ROOT, else `default_transfer_root()`."""
    if root is not None:
        return Path(root)
    if os.environ.get(TRANSFER_ROOT_ENV):
        return Path(os.environ[TRANSFER_ROOT_ENV])
    return default_transfer_root()


def space_hint(root: Path, needed: int, free: int) -> str:
    return (
        f"{needed / 2**20:.1f} MiB of transfer space are needed in {root} but only "
        f"{free / 2**20:.1f} MiB are free. Give it more room (Docker's default /dev/shm is 64 MiB: "
        "start the container with --shm-size=16g or --ipc=host), or point --transfer-root (or "
        f"${TRANSFER_ROOT_ENV}) at a folder with room, or lower --seq-length"
    )


def check_transfer_space(options, facts) -> None:
    """Refuse before any work when one sample of the longest length cannot be carried."""
    root = resolve_transfer_root(options.transfer_root)
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(
            f"transfer root {root} is not a writable folder; pass --transfer-root (or set "
            f"${TRANSFER_ROOT_ENV}) to one"
        )
    dtype = options.dtype
    if dtype == "auto":
        dtype = str(
            facts.config_dict.get("torch_dtype") or facts.config_dict.get("dtype") or "bfloat16"
        )
    itemsize = _DTYPE_BYTES.get(dtype, 4)
    needed = len(facts.layer_ids) * facts.hidden_size * itemsize * options.seq_length
    free = shutil.disk_usage(root).free
    if needed > free:
        raise ValueError(space_hint(root, needed, free))


def default_transfer_root() -> Path:
    """RAM-backed /dev/shm where it exists and is writable, else the temp dir (page cache)."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return _SHM
    return Path(tempfile.gettempdir())


def map_shared(path: str | os.PathLike, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map an existing transfer file as a writable tensor shared with every other mapping."""
    numel = 1
    for dim in shape:
        numel *= dim
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


_PREFIX = "speculators-"


def _remove_orphans(base: Path) -> None:
    """Delete transfer dirs of processes that died without cleaning up (killed with SIGKILL)."""
    if not base.is_dir():
        return
    for entry in base.glob(f"{_PREFIX}*"):
        pid_text = entry.name[len(_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            continue  # alive, another user's


class TransferDir:
    """A private directory of per-request transfer files, removed on `cleanup()`."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        base = Path(root) if root is not None else default_transfer_root()
        _remove_orphans(base)
        self.path = base / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir(mode=0o700, parents=True)

    def file_for(self, request_id: str) -> Path:
        return self.path / f"{request_id}.bin"

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def allocate(self, request_id: str, nbytes: int) -> None:
        """Create the request's file at its full size (sparse until written)."""
        with open(self.file_for(request_id), "wb") as handle:
            handle.truncate(nbytes)

    def take(
        self, request_id: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Map the finished request's file for the caller and unlink it.

        Returns one tensor per leading index (per captured layer), each with its own storage over
        its part of a private copy-on-write mapping: no copy is made, and saving one layer saves
        only that layer. The mapping outlives the unlink; memory is freed with the tensors.
        """
        path = self.file_for(request_id)
        item = torch.empty((), dtype=dtype).element_size()
        per_part = item
        for dim in shape[1:]:
            per_part *= dim
        with open(path, "r+b") as handle:
            mapping = mmap.mmap(handle.fileno(), per_part * shape[0], access=mmap.ACCESS_COPY)
        path.unlink()
        parts = []
        for index in range(shape[0]):
            flat = torch.frombuffer(
                mapping, dtype=dtype, count=per_part // item, offset=index * per_part
            )
            parts.append(flat.view(shape[1:]))
        return parts

    def discard(self, request_id: str) -> None:
        self.file_for(request_id).unlink(missing_ok=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
