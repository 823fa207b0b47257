"""Output paths checked before the work that fills them: a command that runs for minutes or
hours must not fail at its last step because its output cannot be written there.

Both checks raise `ValueError` with one line naming the flag, the path and what is wrong; they
create nothing.
"""

from __future__ import annotations

import os
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
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{flag} {path} is not writable ({probe}); choose another folder")


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
