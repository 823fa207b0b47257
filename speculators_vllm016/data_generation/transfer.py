"""Shared-memory files that carry captured hidden states from the workers to the driver.

Each request gets one file, created by the driver before the request is scheduled:
`[num_layers, seq_len, hidden_size]` in the model dtype, then (8-byte aligned) one int64 per layer
slot counting the rows the worker wrote there (`TransferLayout` is the only place that knows these
offsets). The worker maps it and writes rows as the prefill chunks run, and the row counts once the
request's last chunk is in; the driver maps it when the request has finished and unlinks it at
once, so the tensors it returns are backed by memory that disappears with them. Nothing crosses
vLLM's RPC queue per request: not the rows, not their counts.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from speculators_vllm016.utils.errors import InvalidInputError, RunFailedError

__all__ = [
    "TRANSFER_ROOT_ENV",
    "MappedRequest",
    "TakenRequest",
    "TransferDir",
    "TransferLayout",
    "TransferSpaceError",
    "check_transfer_space",
    "default_transfer_root",
    "map_request",
    "request_file",
    "resolve_transfer_root",
]

_SHM = Path("/dev/shm")


TRANSFER_ROOT_ENV = "SPECULATORS_TRANSFER_ROOT"
_COUNT_DTYPE = torch.int64
_COUNT_BYTES = 8


@dataclass(frozen=True)
class TransferLayout:
    """Byte layout of one request's transfer file; driver, worker and space checks all use it.

    `[num_layers, seq_len, hidden_size]` rows in the model dtype from offset 0, then at
    `counts_offset` one int64 per layer slot: the rows the capturing worker wrote into that slot.
    """

    num_layers: int
    hidden_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, num_layers: int, hidden_size: int, dtype: torch.dtype | str) -> TransferLayout:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."))
        return cls(num_layers=num_layers, hidden_size=hidden_size, dtype=dtype)

    @property
    def layer_row_bytes(self) -> int:
        """One token of one layer."""
        return self.hidden_size * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """One token across every captured layer: what a prompt token costs in transfer space."""
        return self.num_layers * self.layer_row_bytes

    def layer_offset(self, seq_len: int, slot: int) -> int:
        return slot * seq_len * self.layer_row_bytes

    def counts_offset(self, seq_len: int) -> int:
        data = seq_len * self.token_bytes
        return -(-data // _COUNT_BYTES) * _COUNT_BYTES

    def file_bytes(self, seq_len: int) -> int:
        return self.counts_offset(seq_len) + self.num_layers * _COUNT_BYTES

    def seq_len_of(self, file_bytes: int) -> int:
        """The prompt length a file of this size was made for; refuses sizes no length gives."""
        counts = self.num_layers * _COUNT_BYTES
        seq_len = (file_bytes - counts) // self.token_bytes
        if seq_len < 1 or self.file_bytes(seq_len) != file_bytes:
            raise RunFailedError(
                f"a transfer file of {file_bytes} bytes does not fit the layout of {self.num_layers} "
                f"layers x {self.hidden_size} {self.dtype} (another generator's file?)"
            )
        return seq_len


def request_file(directory: str | os.PathLike, request_id: str) -> Path:
    """The transfer file of one request inside a generator's transfer directory."""
    return Path(directory) / f"{request_id}.bin"


@dataclass(frozen=True)
class MappedRequest:
    """A worker's writable view of a request's file: the rows and the per-slot row counts."""

    rows: torch.Tensor  # [num_layers, seq_len, hidden_size], model dtype
    counts: torch.Tensor  # [num_layers] int64


def map_request(path: str | os.PathLike, layout: TransferLayout) -> MappedRequest:
    """Map an existing transfer file shared with every other mapping (writes reach the driver)."""
    size = os.stat(path).st_size
    seq_len = layout.seq_len_of(size)
    raw = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    data_bytes = seq_len * layout.token_bytes
    rows = raw[:data_bytes].view(layout.dtype).view(layout.num_layers, seq_len, layout.hidden_size)
    start = layout.counts_offset(seq_len)
    counts = raw[start : start + layout.num_layers * _COUNT_BYTES].view(_COUNT_DTYPE)
    return MappedRequest(rows=rows, counts=counts)


@dataclass(frozen=True)
class TakenRequest:
    """What the driver gets back for a finished request."""

    hidden_states: list[torch.Tensor]  # one [seq_len, hidden_size] tensor per layer slot
    rows_written: list[int]  # per layer slot, as the capturing worker counted them


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
        raise InvalidInputError(
            f"transfer root {root} is not a writable folder; pass --transfer-root (or set "
            f"${TRANSFER_ROOT_ENV}) to one"
        )
    dtype = options.dtype
    if dtype == "auto":
        dtype = str(
            facts.config_dict.get("torch_dtype") or facts.config_dict.get("dtype") or "bfloat16"
        )
    try:
        layout = TransferLayout.of(len(facts.layer_ids), facts.hidden_size, dtype)
    except (AttributeError, TypeError):
        layout = TransferLayout.of(len(facts.layer_ids), facts.hidden_size, torch.float32)
    needed = layout.file_bytes(options.seq_length)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise InvalidInputError(space_hint(root, needed, free))


class TransferSpaceError(InvalidInputError):
    """The transfer root has no room for a request's hidden states."""


def default_transfer_root() -> Path:
    """RAM-backed /dev/shm where it exists and is writable, else the temp dir (page cache)."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return _SHM
    return Path(tempfile.gettempdir())


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
        return request_file(self.path, request_id)

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

    def take(self, request_id: str, layout: TransferLayout, seq_len: int) -> TakenRequest:
        """Map the finished request's file for the caller and unlink it.

        Returns one tensor per layer slot, each with its own storage over its part of a private
        copy-on-write mapping: no copy is made, and saving one layer saves only that layer. The
        mapping outlives the unlink; memory is freed with the tensors.
        """
        path = self.file_for(request_id)
        with open(path, "r+b") as handle:
            mapping = mmap.mmap(
                handle.fileno(), layout.file_bytes(seq_len), access=mmap.ACCESS_COPY
            )
        path.unlink()
        parts = []
        for slot in range(layout.num_layers):
            flat = torch.frombuffer(
                mapping,
                dtype=layout.dtype,
                count=seq_len * layout.hidden_size,
                offset=layout.layer_offset(seq_len, slot),
            )
            parts.append(flat.view(seq_len, layout.hidden_size))
        counts = torch.frombuffer(
            mapping,
            dtype=_COUNT_DTYPE,
            count=layout.num_layers,
            offset=layout.counts_offset(seq_len),
        )
        return TakenRequest(hidden_states=parts, rows_written=counts.tolist())

    def discard(self, request_id: str) -> None:
        self.file_for(request_id).unlink(missing_ok=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
