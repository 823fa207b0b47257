"""Resuming a run: the progress it continues from, reconciled with the run being started.

A checkpoint records what exact resume depends on besides weights and optimizer: the number of
processes, the seed, a digest of the training files and `--deterministic`. A resumed run that
differs in one of them still continues (the user may mean it), with a warning saying what will
not match an uninterrupted run, and records its own values from then on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

from speculators_vllm016.train.checkpointer import CheckpointRef, TrainingState
from speculators_vllm016.train.data import Eagle3SampleFileDataset

__all__ = ["reconcile_resumed_state", "training_data_digest"]

logger = logging.getLogger("speculators")


def training_data_digest(loader: Any) -> str | None:
    """A hash of the training files' names and token counts, in order (the sampler's plans
    depend on them); None when the loader's dataset does not list them."""
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, Eagle3SampleFileDataset):
        return None
    digest = hashlib.sha256()
    for path, length in zip(dataset.data, dataset.lengths, strict=True):
        digest.update(f"{Path(path).name}\t{int(length)}\n".encode())
    return digest.hexdigest()[:16]


def reconcile_resumed_state(
    checkpoint: CheckpointRef,
    *,
    steps_per_epoch: int,
    world_size: int,
    seed: int,
    data_digest: str | None,
    deterministic: bool,
) -> TrainingState:
    """The progress to continue from `checkpoint`, with this run's settings recorded."""
    state = dataclasses.replace(checkpoint.state)
    if checkpoint.legacy:
        # 0.3.0 kept no step counter: the end of epoch e is (e + 1) epochs of steps.
        state.global_step = (checkpoint.state.epoch + 1) * steps_per_epoch
    if state.world_size != world_size:
        logger.warning(
            "checkpoint written with %d processes, resuming with %d: the batches of the rest "
            "of the run differ from an uninterrupted one", state.world_size, world_size,
        )
        state.world_size = world_size
    if not checkpoint.legacy and state.seed != seed:
        logger.warning(
            "checkpoint written with --seed %d, resuming with --seed %d: the batches and noise "
            "of the rest of the run differ from an uninterrupted one", state.seed, seed,
        )
    state.seed = seed  # the seed the rest of the run uses
    if state.data_digest is not None and data_digest is not None and state.data_digest != data_digest:
        logger.warning(
            "checkpoint written for other training data (sample files added, removed or "
            "changed length): the batches of the rest of the run differ from an "
            "uninterrupted one"
        )
    state.data_digest = data_digest
    recorded = state.deterministic
    if recorded is not None and recorded != deterministic:
        logger.warning(
            "checkpoint written %s --deterministic, resuming %s it: on a GPU the rest of the "
            "run does not end bit for bit where an uninterrupted one would",
            "with" if recorded else "without", "without" if recorded else "with",
        )
    state.deterministic = deterministic
    return state
