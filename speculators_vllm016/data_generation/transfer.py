"""Shared-memory files that carry captured hidden states from the workers to the driver.

Each request gets one file `[num_layers, seq_len, hidden_size]` in the model dtype, created by the
driver before the request is scheduled. The worker maps it and writes rows as the prefill chunks
run; the driver maps it when the request has finished and unlinks it at once, so the tensors it
returns are backed by memory that disappears with them. Nothing bulky crosses vLLM's RPC queue.
"""

from __future__ import annotations

import errno
import fcntl
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
    "TransferSpaceError",
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


class TransferSpaceError(ValueError):
    """The transfer root has no room for a request's hidden states."""


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


_LOCK = ".lock"


def _remove_orphans(base: Path) -> None:
    """Delete transfer dirs whose owner died without cleaning up (killed with SIGKILL).

    A live owner holds a lock on the dir's `.lock` file (released by the kernel when it dies,
    whatever container or PID namespace it runs in); a dir without that file is not ours and
    is left alone, as is any dir whose lock is held.
    """
    if not base.is_dir():
        return
    for entry in base.glob(f"{_PREFIX}*"):
        lock = entry / _LOCK
        try:
            if not entry.is_dir() or not lock.is_file():
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # another user's, or gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        shutil.rmtree(entry, ignore_errors=True)


class TransferDir:
    """A private directory of per-request transfer files, removed on `cleanup()`.

    The directory is marked live by a lock held for the object's life (see `_remove_orphans`).
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        base = resolve_transfer_root(root)
        _remove_orphans(base)
        self.path = base / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir(mode=0o700, parents=True)
        self._lock_fd: int | None = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def file_for(self, request_id: str) -> Path:
        return self.path / f"{request_id}.bin"

    def request_files(self) -> list[Path]:
        """The per-request files present now (the directory's own lock file is not one)."""
        return sorted(entry for entry in self.path.iterdir() if entry.name != _LOCK)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def allocate(self, request_id: str, nbytes: int) -> None:
        """Create the request's file with all its space reserved now.

        A sparse file would take its pages only as the worker writes them, and a full tmpfs then
        kills the worker with SIGBUS; reserving up front turns that into `TransferSpaceError`.
        """
        path = self.file_for(request_id)
        with open(path, "wb") as handle:
            try:
                if nbytes > 0:
                    os.posix_fallocate(handle.fileno(), 0, nbytes)
            except OSError as error:
                path.unlink(missing_ok=True)
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise TransferSpaceError(
                        space_hint(self.path.parent, nbytes, self.free_bytes())
                    ) from None
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                handle.truncate(nbytes)  # no reservation on this file system

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
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
