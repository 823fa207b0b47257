"""Where a conversion may write, and publishing it whole.

The result is built in a hidden folder beside the destination, validated there, and renamed into
place only when everything passed; a failure removes it and leaves the destination as it was.
The input and verifier folders are never written to, nor any folder holding them; a non-empty
destination is replaced only when the caller asks.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from speculators_vllm016.utils.atomic_files import replace_folder
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["check_output_path", "staged_output"]


def _related(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output_path(
    output_path: str | Path, protected: Iterable[str | Path], overwrite: bool
) -> Path:
    """The resolved destination; refuses protected folders and a non-empty one unless `overwrite`."""
    target = Path(output_path).expanduser().resolve()
    for source in protected:
        local = Path(source).expanduser()
        if local.exists() and _related(target, local.resolve()):
            raise InvalidInputError(
                f"--output-path {output_path} would overwrite {source} (the checkpoint or the "
                "verifier); choose another --output-path"
            )
    if target.exists() and not target.is_dir():
        raise InvalidInputError(f"--output-path {output_path} is a file; name a folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise InvalidInputError(
            f"--output-path {output_path} is not empty; pass --overwrite to replace it or choose "
            "another folder"
        )
    return target


@contextmanager
def staged_output(target: Path) -> Iterator[Path]:
    """Yield a fresh folder to write into; on success it replaces `target`, on error it goes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = target.parent / f".{target.name}.converting-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    aside = target.parent / f".{target.name}.replaced-{uuid.uuid4().hex[:8]}"
    replace_folder(stage, target, aside=aside, fsync=False)
