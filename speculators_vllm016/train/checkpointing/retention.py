"""Which checkpoints stay: the `best` link, mid-epoch pruning, `keep_last`, an earlier run's removal.

`CheckpointRetention` is a part of `checkpointer.BaseCheckpointer` (it reads the checkpointer's
folder, its list of complete checkpoints and its settings); it lives here so that the
checkpointer module keeps to writing and reading. Deletions rename a folder to a hidden
temporary name before removing it: a process killed half way through a deletion leaves no folder
that looks complete with files missing, and the next start sweeps the temporary one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["BEST_LINK", "CheckpointRetention", "TEMP_PREFIX"]

logger = logging.getLogger("speculators_vllm016.train.checkpointer")

BEST_LINK = "best"
TEMP_PREFIX = ".tmp-"
"""Checkpoint folders are assembled (and deleted) under `.tmp-<name>`; the start sweeps them."""
_MID_EPOCH = re.compile(r"^(\d+)-step(\d+)$")


class CheckpointRetention:
    """Retention for a checkpointer (mixed into `BaseCheckpointer`)."""

    path: Path
    # `checkpointer.CheckpointRef`s, oldest first (named loosely: that module imports this one)
    checkpoints: list[Any]
    earlier_run: list[Any]
    keep_mid_epoch: int | None
    keep_last: int | None

    def refresh(self) -> None:  # the checkpointer's
        raise NotImplementedError

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def point_best(self, name: str) -> None:
        """Make `<path>/best` point at checkpoint `name` (rank 0; atomic)."""
        if self._rank() != 0:
            return
        link = self.path / BEST_LINK
        temporary = self.path / f"{TEMP_PREFIX}{BEST_LINK}-link"
        temporary.unlink(missing_ok=True)
        os.symlink(name, temporary)
        os.replace(temporary, link)

    def remove(self, names: list[str]) -> None:
        """Delete checkpoints `names` in that order, and the `best` link if it names one (rank 0)."""
        if self._rank() == 0:
            best = self.path / BEST_LINK
            if best.is_symlink() and os.readlink(best) in set(names):
                best.unlink()
            for name in names:
                self._delete(self.path / name)
        self.refresh()

    # -- retention ---------------------------------------------------------------------------
    def replace_earlier_run(self) -> None:
        """The checkpoints now here belong to a run this one replaces: `save` deletes them
        right before this run's first checkpoint. A run stopped before that leaves the earlier
        one intact; after it, resume and pruning see only this run."""
        self.earlier_run = list(self.checkpoints)

    def _remove_earlier_run(self) -> None:
        """Newest first, so an interrupted removal leaves a (shorter) earlier run, never a mix."""
        earlier, self.earlier_run = self.earlier_run, []
        self.remove([ref.name for ref in reversed(earlier)])
        logger.info("removed the %d checkpoints of the earlier run", len(earlier))

    def prune_mid_epoch(self, just_saved: str) -> None:
        """Keep the newest `keep_mid_epoch` mid-epoch checkpoints after the newest epoch one, and
        `just_saved` (so 0 keeps just that one, like 1); older mid-epoch ones are deleted."""
        assert self.keep_mid_epoch is not None
        newest_epoch = max(
            (ref.sort_key() for ref in self.checkpoints if ref.state.epoch_complete),
            default=(-1, 0),
        )
        recent = [
            ref.name
            for ref in self.checkpoints
            if not ref.state.epoch_complete and ref.sort_key() > newest_epoch
        ]
        count = self.keep_mid_epoch
        keep = set(recent[-count:]) if count > 0 else set()
        self.prune(keep | {just_saved})

    def apply_retention(self, just_saved: str) -> None:
        """`keep_mid_epoch` (see `prune_mid_epoch`), then `keep_last`: of all checkpoints, the
        newest `keep_last`, `just_saved` and the one `best` names stay; older ones go."""
        if self.keep_mid_epoch is not None:
            self.prune_mid_epoch(just_saved)
        if self.keep_last is None or self._rank() != 0:
            return
        keep = {ref.name for ref in self.checkpoints[-self.keep_last :]} | {just_saved}
        best_target = self._best_target()
        for ref in self.checkpoints:
            if ref.name not in keep and ref.name != best_target:
                self._delete(ref.path)
        self.refresh()

    def _best_target(self) -> str | None:
        best = self.path / BEST_LINK
        return os.readlink(best) if best.is_symlink() else None

    def _delete(self, folder: Path) -> None:
        """Delete a checkpoint folder: renamed to a temporary name first, so that a kill half
        way through never leaves a complete-looking checkpoint with files missing."""
        doomed = self.path / f"{TEMP_PREFIX}deleted-{folder.name}"
        shutil.rmtree(doomed, ignore_errors=True)
        try:
            os.replace(folder, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def prune(self, keep: set[str]) -> None:
        """Delete mid-epoch checkpoints not in `keep` (epoch folders are always kept)."""
        if self._rank() != 0:
            return
        best_target = self._best_target()
        for ref in self.checkpoints:
            if _MID_EPOCH.match(ref.name) and ref.name not in keep and ref.name != best_target:
                self._delete(ref.path)
        self.refresh()
