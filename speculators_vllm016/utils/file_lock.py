"""Exclusive locks on files that the kernel releases however the holder ends.

`flock` is used rather than process ids in a file: a lock held by a process that was killed
(SIGKILL, out of memory, a lost node) is gone with it, also over NFS, so a later run never has to
guess whether the process that wrote a pid is still alive. Datagen's shard and writer locks and
the trainer's save-path lock all take theirs here.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["try_lock_file"]


def try_lock_file(path: str | os.PathLike) -> int | None:
    """An fd holding an exclusive lock on `path` (created if missing), or None if it is held.

    The lock lasts until the fd is closed or the process ends.
    """
    fd = os.open(Path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
