"""Output paths checked before the work that fills them: a command that runs for minutes or
hours must not fail at its last step because its output cannot be written there.

Both checks raise `ValueError` with one line naming the flag, the path and what is wrong; they
leave nothing behind. Where the path would be created, an empty probe folder is made in its
nearest existing folder and removed at once: `os.access` answers yes to root everywhere, and
places such as /proc refuse new entries that the permission bits allow.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["check_output_file", "check_output_folder"]


def _existing_ancestor(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_output_folder(path: str | os.PathLike, flag: str) -> None:
    """`path` is, or can be created as, a writable folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InvalidInputError(f"{flag} {path} is a file; give a folder")
    probe = _existing_ancestor(path)
    if not probe.is_dir():
        raise InvalidInputError(
            f"{flag} {path} cannot be created: {probe} is a file; choose another folder"
        )
    if not os.access(probe, os.W_OK | os.X_OK) or (probe != path and not _can_create_in(probe)):
        raise InvalidInputError(f"{flag} {path} is not writable ({probe}); choose another folder")


def _can_create_in(folder: Path) -> bool:
    """An entry can be made in `folder` (tried: an empty folder, removed again)."""
    try:
        made = tempfile.mkdtemp(prefix=".speculators-write-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(made)
    return True


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """`path` is, or can be created as, a writable file (its folder is created when written)."""
    path = Path(path)
    if path.is_dir():
        raise InvalidInputError(f"{flag} {path} is a folder; give a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise InvalidInputError(f"{flag} {path} is not writable; choose another place")
        return
    check_output_folder(path.parent, flag)
