"""One training process per save path: a lock held for the run's life.

Two runs writing into one save path overwrite each other's checkpoints and interleave their
metrics. The trainer holds an exclusive `flock` on `<save>/.train.lock` while it runs (rank 0 for
all ranks); the kernel releases it when the process ends, however it ends (SIGKILL, a crash), so
no stale lock is ever left to clean up. This is how datagen's writer slots and shard locks work
(`data_generation.sample_io`), with one addition: the holder writes its pid and host into the
file, so the refused run can say which process to wait for.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from speculators_vllm016.train.errors import SavePathInUse
from speculators_vllm016.utils.file_lock import try_lock_file

__all__ = ["LOCK_FILE", "SavePathLock"]

LOCK_FILE = ".train.lock"


class SavePathLock:
    """The lock on one save path; `acquire` raises `SavePathInUse` naming the holder."""

    def __init__(self, save_path: str | os.PathLike) -> None:
        self.folder = Path(save_path)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (no-op if this object holds it already)."""
        if self._fd is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = try_lock_file(self.path)
        if fd is None:
            raise SavePathInUse(
                f"another training process ({self.holder()}) is training into {self.folder}; "
                "wait for it to end, or give this run another save path (--save-path)"
            )
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._fd = fd

    def holder(self) -> str:
        """Who holds the lock, as its file says ("pid unknown" while it is still writing it)."""
        try:
            words = self.path.read_text().split()
        except OSError:
            words = []
        if len(words) >= 2:
            return f"pid {words[0]} on {words[1]}"
        return f"pid {words[0]}" if words else "pid unknown"

    def release(self) -> None:
        """Let go (the file stays: removing it could let two processes lock two files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SavePathLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
