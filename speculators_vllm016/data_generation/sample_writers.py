"""Threads that write sample files while the engine goes on extracting."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from speculators_vllm016.data_generation.manifest import ManifestWriter, SampleRecord
from speculators_vllm016.data_generation.sample_io import WriterSlot, WrittenFile, write_sample_file

__all__ = ["SampleWriterPool"]


class SampleWriterPool:
    """Writes samples on worker threads while extraction goes on.

    At most `max_pending` samples wait for a writer: beyond that, `submit` waits for the oldest,
    so memory stays bounded when the disk is slower than the engine. A file is listed in the
    manifest once it is whole under its name.
    """

    def __init__(
        self,
        num_threads: int,
        output_format: str,
        fsync: bool = False,
        max_pending: int = 64,
        slot: WriterSlot | None = None,
        manifest: ManifestWriter | None = None,
        storage_dtype: str = "bf16",
    ) -> None:
        self.output_format = output_format
        self.storage_dtype = storage_dtype
        self.fsync = fsync
        self.slot = slot
        self.manifest = manifest
        self.max_pending = max(1, max_pending)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="sample-writer")
        self._pending: deque[Future] = deque()
        self.written = 0

    def _write(self, path: Path, sample: dict, index: int) -> WrittenFile:
        written = write_sample_file(
            path, sample, self.output_format, self.fsync, self.slot, self.storage_dtype
        )
        if self.manifest is not None:  # the file is whole under its name: now it is listed
            length = int(torch.as_tensor(sample["input_ids"]).numel())
            self.manifest.append(
                SampleRecord(path.name, index, length, written.bytes, written.sha256)
            )
        return written

    def submit(self, path: Path, sample: dict, index: int = -1) -> None:
        self._pending.append(self._pool.submit(self._write, path, sample, index))
        while len(self._pending) > self.max_pending:
            self._collect_oldest()

    def _collect_oldest(self) -> None:
        self._pending.popleft().result()
        self.written += 1

    def drain(self) -> None:
        """Wait for every write submitted so far; re-raise the first failure."""
        while self._pending:
            self._collect_oldest()

    def finish(self) -> int:
        """Wait for every write; re-raise the first failure. Returns samples written."""
        try:
            while self._pending:
                self._collect_oldest()
        finally:
            self._pool.shutdown(wait=True)
        return self.written

    def __enter__(self) -> SampleWriterPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()
