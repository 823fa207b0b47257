"""Files that appear whole or not at all: write under a temporary name, then rename.

Every module that writes a file a crash must not leave half-written (sample files, checkpoints,
vocabulary maps, token counts, run records, metrics logs) goes through here, so there is one
temporary-name scheme for the whole package: `.{name}.{random}.tmp` beside the target.
A reader never sees a partial file, and a crash leaves at most a hidden temporary file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "TEMP_SUFFIX",
    "WriteErrorKeeper",
    "real_write_errors",
    "atomic_torch_save",
    "atomic_write",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_folder",
    "give_usual_modes",
    "replace_folder",
    "restore_replaced_folder",
    "temporary_path",
    "torch_save",
    "usual_file_mode",
]

TEMP_SUFFIX = ".tmp"


def temporary_path(path: Path) -> Path:
    """A hidden name beside `path` that no other writer (thread or process) picks too."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def fsync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable (the directory entry itself is flushed)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _current_umask() -> int:
    """The process umask, read without changing it where Linux says it (`os.umask` sets it,
    a moment another thread could create a file in)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def usual_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the umask (0o644 under 022)."""
    return 0o666 & ~_current_umask()


def give_usual_modes(folder: str | os.PathLike) -> None:
    """Give every file in `folder` (and below) the mode a plain `open` would have given it.

    safetensors 0.8 writes through a temporary file it creates 0600 and renames into place, so
    a draft's weights were unreadable to a server running as another user while the config
    beside them was readable. Writers of a model folder call this once the folder is written.
    """
    mode = usual_file_mode()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[IO[bytes]], Any],
    *,
    fsync: bool = False,
    temp: Path | None = None,
) -> Path:
    """Call `write(handle)` on a temporary file, then rename it to `path`.

    `fsync` also flushes the data and the folder, so the file survives a power loss and not
    only a crash of this process. `temp` lets a caller that tracks its own temporary files
    (to sweep them after a crash) choose the name. On any error the temporary file is removed
    and the error propagates; an existing `path` is left as it was.
    """
    path = Path(path)
    temp = temporary_path(path) if temp is None else temp
    try:
        with open(temp, "wb") as handle:
            write(handle)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_folder(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> Path:
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")), fsync=fsync)


def atomic_write_json(
    path: str | os.PathLike, payload: Any, *, indent: int | None = 2, sort_keys: bool = False
) -> Path:
    return atomic_write_text(path, json.dumps(payload, indent=indent, sort_keys=sort_keys))


class WriteErrorKeeper:
    """A binary handle that remembers the `OSError` a write raised.

    torch.save's zip writer swallows the error of a failed write (a full disk) and fails with a
    position mismatch instead; `real_write_errors` raises the kept error, so the user is told
    that the disk is full.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self._handle.flush()


@contextlib.contextmanager
def real_write_errors(keeper: WriteErrorKeeper | None) -> Iterator[None]:
    """Raise the write error `keeper` kept in place of the one a serializer made of it."""
    try:
        yield
    except BaseException as failure:
        if keeper is not None and keeper.error is not None and keeper.error is not failure:
            raise keeper.error from failure
        raise


def torch_save(obj: Any, target: str | os.PathLike | IO[bytes]) -> None:
    """`torch.save` to a path or an open handle, raising a failed write's own `OSError`."""
    import torch

    if isinstance(target, (str, os.PathLike)):
        with open(target, "wb") as handle:
            torch_save(obj, handle)
        return
    keeper = WriteErrorKeeper(target)
    with real_write_errors(keeper):
        torch.save(obj, keeper)


def atomic_torch_save(obj: Any, path: str | os.PathLike, *, fsync: bool = False) -> Path:
    return atomic_write(path, lambda handle: torch_save(obj, handle), fsync=fsync)


def replace_folder(
    source: Path, target: Path, *, aside: Path | None = None, fsync: bool = True
) -> None:
    """Rename the folder `source` to `target`, replacing an existing `target`.

    A folder cannot be swapped in one rename; the old one is first moved aside under a hidden
    name (`aside`; by default `.old-<name>`), so at every moment either the old or the new
    folder is complete under some name. When the second rename fails, the old folder goes back
    under its name before the error propagates; a process killed between the two renames leaves
    the old one aside, and `restore_replaced_folder` (called by the owner before it sweeps its
    leftovers) puts it back.
    """
    if target.exists():
        old = target.with_name(f".old-{target.name}") if aside is None else aside
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        try:
            os.replace(source, target)
        except BaseException:
            os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, target)
    if fsync:
        fsync_folder(target.parent)


def restore_replaced_folder(target: Path, aside: Path) -> bool:
    """Put `aside` back as `target` when a `replace_folder` was cut between its two renames
    (`target` missing, the old folder whole under `aside`); True when it did. With `target`
    there, `aside` is only a leftover (perhaps half deleted) and stays for the caller's sweep."""
    if target.exists() or target.is_symlink() or not aside.is_dir():
        return False
    os.replace(aside, target)
    return True
