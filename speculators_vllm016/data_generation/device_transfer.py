"""Moving captured rows from the accelerator into the host transfer buffers, off the critical path.

On the CPU build a row copy is a plain memcpy. On a GPU, each captured layer's rows go in one
asynchronous copy on a side stream into a pinned staging buffer; a background thread waits for the
copy's event and scatters the rows into the per-request shared-memory buffers. The forward pass
never waits for the host: it only enqueues a copy. `flush()` waits until everything enqueued has
reached its destination (the generator calls it before handing results to the driver).
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from speculators_vllm016.utils.errors import RunFailedError

__all__ = ["RowTarget", "RowWriter"]


@dataclass(frozen=True)
class RowTarget:
    """Rows `[row, row + count)` of a source go to `destination` (a host tensor of `count` rows)."""

    destination: torch.Tensor
    row: int
    count: int


class _StagingPool:
    """Reusable pinned host buffers, handed out by size and given back after the scatter."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = 1 << max(nbytes - 1, 1).bit_length()  # round up: few distinct sizes to reuse
        with self._lock:
            if self._free[size]:
                return self._free[size].pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free[buffer.numel()].append(buffer)


class RowWriter:
    """Writes rows of (possibly device) tensors into host tensors; see the module docstring."""

    def __init__(self, max_pending: int = 16) -> None:
        self._pool = _StagingPool()
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copy_stream = None

    def write_rows(self, source: torch.Tensor, targets: list[RowTarget]) -> None:
        """Copy `source[t.row : t.row + t.count]` into each `t.destination`."""
        self._raise_pending_error()
        if not targets:
            return
        if source.device.type == "cpu":
            for target in targets:
                target.destination.copy_(source[target.row : target.row + target.count])
            return
        self._write_from_device(source, targets)

    def _write_from_device(self, source: torch.Tensor, targets: list[RowTarget]) -> None:
        source = source.contiguous()
        nbytes = source.numel() * source.element_size()
        staging = self._pool.take(nbytes)
        staged = staging[:nbytes].view(source.dtype).view(source.shape)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=source.device)
        producer = torch.cuda.current_stream(source.device)
        self._copy_stream.wait_stream(producer)
        with torch.cuda.stream(self._copy_stream):
            staged.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        # The caching allocator must not hand `source` to another kernel before the copy ran.
        source.record_stream(self._copy_stream)
        self._ensure_thread()
        self._jobs.put((done, staging, staged, targets))

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._scatter_loop, name="speculators-row-writer", daemon=True
            )
            self._thread.start()

    def _scatter_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                done, staging, staged, targets = job
                try:
                    done.synchronize()
                    for target in targets:
                        target.destination.copy_(staged[target.row : target.row + target.count])
                except BaseException as exc:  # noqa: BLE001 - reported on the next call
                    self._error = exc
                finally:
                    self._pool.give_back(staging)
            finally:
                self._jobs.task_done()

    def flush(self) -> None:
        """Return once every row written so far is in its destination."""
        if self._thread is not None:
            self._jobs.join()
        self._raise_pending_error()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=10)
        self._thread = None

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RunFailedError("copying captured hidden states to the host failed") from error
