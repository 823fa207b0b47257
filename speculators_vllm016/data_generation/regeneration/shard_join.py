"""The shards of a sharded `datagen --regenerate` run meet here: every shard's regenerated rows,
joined into the one conversations file that the unsharded run writes.

Datagen numbers its samples over the whole (shuffled) data, so shard I cannot tell which samples
are its own before every shard has regenerated its rows. Each shard therefore regenerates rows
I, I+N, ... of the data, waits until the other shards' files are there, and extracts samples
I, I+N, ... of the joined file: the sample files of all shards together are those of the
unsharded run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from speculators_vllm016.data_generation.regeneration.row_log import output_file_names
from speculators_vllm016.utils.atomic_files import atomic_write_text

__all__ = ["join_shard_files", "missing_shards", "wait_for_shards"]

logger = logging.getLogger(__name__)

POLL_SECONDS = 30.0


def shard_file(folder: Path, shard_index: int, num_shards: int) -> Path:
    return folder / output_file_names(shard_index, num_shards)[0]


def missing_shards(folder: Path, num_shards: int) -> list[int]:
    """Shards whose conversations file is not written yet (it appears whole, when the shard
    has finished regenerating)."""
    return [i for i in range(num_shards) if not shard_file(folder, i, num_shards).exists()]


def wait_for_shards(
    folder: Path,
    num_shards: int,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once every shard has written its conversations file into `folder`; says which
    shards it waits for, every poll (the other shards must be running: start them together)."""
    missing = missing_shards(folder, num_shards)
    while missing:
        logger.info(
            "waiting for shards %s of %d to finish regenerating (their files in %s); every "
            "shard's rows are needed to number the samples",
            missing,
            num_shards,
            folder,
        )
        sleep(poll_seconds)
        missing = missing_shards(folder, num_shards)


def join_shard_files(folder: Path, num_shards: int, fsync: bool = False) -> Path:
    """Every shard's rows in data order, as the unsharded run writes them (the same lines, each
    as its shard wrote it), into `folder`'s unsharded conversations file; returns it.

    Every shard writes the same bytes (whole, under a temporary name), so shards that join at
    the same time do not disturb each other.
    """
    lines: list[tuple[int, str]] = []
    for index in range(num_shards):
        text = shard_file(folder, index, num_shards).read_text(encoding="utf-8")
        lines += [(json.loads(line)["row"], line) for line in text.splitlines() if line]
    lines.sort(key=lambda item: item[0])
    target = folder / output_file_names(0, 1)[0]
    joined = "".join(line + "\n" for _, line in lines)
    if not target.exists() or target.read_text(encoding="utf-8") != joined:
        atomic_write_text(target, joined, fsync=fsync)
    return target
