"""The metrics log `<save>/metrics.jsonl`: its record schema, its one writer, its one reader,
and its life across runs of the same save folder.

Record schema (one JSON object a line; the trainer writes two kinds, through the
`speculators.metrics` logger and `logger.JsonlHandler`, which puts `step` first):

    {"step": g, "train": {...}, "epoch": e, "lr": lr}
        one optimizer step. `g` is the step's own index in the run, from 0. `train` holds the
        model's metrics averaged over ranks (`loss`, `loss_k`, `full_acc_k`, `cond_acc_k` for
        TTT step k), `grad_norm`, `tokens` (packed tokens of the step, all ranks), `step_seconds`
        (wall clock since the previous step ended, waiting for data included) and, on CUDA,
        `peak_memory_gib`. `lr` is the learning rate the step used.
    {"step": g, "val": {...}, "epoch": e}
        the validation at the end of epoch `e`, after `g` optimizer steps in all. `val` holds
        the mean of every model metric over the validation rows as `<name>_epoch`, and
        `tau_sim` (`simulated_tau` of the `full_acc_k` means) when the model logs accuracies.

Readers ignore keys they do not know and skip lines that are not JSON objects (a line cut by a
crash must not hide the others). `read_metrics` is the one reader: the trainer's truncation on
resume, evaluation's tau_sim (`evaluate.training_metrics`) and the demo use it.

Life across runs (`MetricsLog`): a run from scratch moves an earlier run's log to
`metrics.jsonl.prev` and writes its own; a resumed run drops the lines the interrupted run wrote
after the checkpoint it resumes from. Only rank 0 touches the files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_vllm016.train.logger import METRICS_FILE, METRICS_LOGGER, flatten
from speculators_vllm016.utils.atomic_files import atomic_write_text

__all__ = [
    "UNCONFIRMED_RUN_FILE",
    "MetricsLog",
    "MetricsRecord",
    "log_train_step",
    "log_validation",
    "read_metrics",
    "read_train_steps",
    "simulated_tau",
    "tau_sim",
]

logger = logging.getLogger("speculators")
metric_logger = logging.getLogger(METRICS_LOGGER)

# Present while a run from scratch has moved the earlier run's metrics to `.prev` but written
# no checkpoint yet. A run killed then (SIGKILL, power loss) leaves it, and the next start puts
# the earlier run's metrics back beside the earlier run's checkpoints, which are still there.
UNCONFIRMED_RUN_FILE = ".run-without-checkpoint"


def simulated_tau(full_acc: Iterable[float]) -> float:
    """tau_sim = 1 + sum over TTT steps k of `full_acc_k`: the acceptance length a greedy chain
    would reach if acceptance on generated text matched the teacher-forced accuracies."""
    return 1.0 + float(sum(full_acc))


def tau_sim(metrics: Mapping[str, float]) -> float | None:
    """`simulated_tau` of the `full_acc_k` entries of `metrics`, None when it has none."""
    accuracies = [value for key, value in metrics.items() if key.startswith("full_acc_")]
    return simulated_tau(accuracies) if accuracies else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class MetricsRecord:
    """One line of `metrics.jsonl` (see the module docstring for the schema).

    `raw` is the line's object as written, other writers' keys included: the trainer writes kept
    lines back unchanged from it, and evaluation also accepts flat `val/full_acc_k` keys there.
    """

    step: int | None = None
    epoch: int | None = None
    lr: float | None = None
    train: dict[str, Any] | None = None
    val: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_object(cls, raw: dict[str, Any]) -> MetricsRecord:
        lr = raw.get("lr")
        train, val = raw.get("train"), raw.get("val")
        return cls(
            step=_int_or_none(raw.get("step")),
            epoch=_int_or_none(raw.get("epoch")),
            lr=float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None,
            train=train if isinstance(train, dict) else None,
            val=val if isinstance(val, dict) else None,
            raw=raw,
        )

    def flat(self) -> dict[str, Any]:
        """The record's keys joined with "/" (`{"val": {"x": 1}}` -> `{"val/x": 1}`)."""
        return flatten(self.raw)

    def to_line(self) -> str:
        """The record as the JSONL handler writes it (one line, no newline)."""
        return json.dumps(self.raw, default=float)


def read_metrics(path: str | os.PathLike) -> list[MetricsRecord]:
    """Every record of a metrics log in file order; [] when there is no file."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if isinstance(entry, dict):
            records.append(MetricsRecord.from_object(entry))
    return records


def read_train_steps(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The optimizer steps of a metrics log as flat rows, `{"step": g, **train}`, in file order."""
    return [
        {"step": record.step, **record.train}
        for record in read_metrics(path)
        if record.train is not None
    ]


def log_train_step(step: int, epoch: int, lr: float, metrics: Mapping[str, float]) -> None:
    """Log one optimizer step's record (every metrics backend gets it; the JSONL file on rank 0)."""
    metric_logger.info({"train": dict(metrics), "epoch": epoch, "lr": lr}, extra={"step": step})


def log_validation(step: int, epoch: int, means: Mapping[str, float]) -> None:
    """Log the validation record of epoch `epoch`, after `step` optimizer steps in all."""
    metric_logger.info({"val": dict(means), "epoch": epoch}, extra={"step": step})


class MetricsLog:
    """The metrics file of one save folder across runs: start, restore, truncate (rank 0 only)."""

    def __init__(self, save_path: str | os.PathLike, rank: int = 0) -> None:
        self.folder = Path(save_path)
        self.rank = rank

    @property
    def path(self) -> Path:
        return self.folder / METRICS_FILE

    @property
    def previous(self) -> Path:
        """Where a run from scratch keeps the earlier run's lines (`metrics.jsonl.prev`)."""
        return self.path.with_name(f"{self.path.name}.prev")

    @property
    def unconfirmed_marker(self) -> Path:
        return self.folder / UNCONFIRMED_RUN_FILE

    def recover_unconfirmed_run(self) -> bool:
        """At start: a marker left by a run from scratch killed before its first checkpoint
        puts the earlier run's metrics back beside its checkpoints. True if it did."""
        if self.rank != 0 or not self.unconfirmed_marker.is_file():
            return False
        self.restore_earlier()
        logger.warning(
            "an earlier run from scratch in %s ended before its first checkpoint, without "
            "cleaning up (killed?): the metrics of the run whose checkpoints are there are "
            "back in %s, its own lines are in %s.prev",
            self.folder,
            METRICS_FILE,
            METRICS_FILE,
        )
        return True

    def start(self, *, replaces_checkpoints: bool) -> bool:
        """A run from scratch starts its own log; an earlier run's lines go to `.prev` until
        this run's first checkpoint replaces the earlier run (`replaces_checkpoints`: there is
        one; the marker records it). A `.prev` from before that goes: this run's log starts
        empty. True if a log was moved."""
        if self.rank != 0:
            return False
        moved = self.path.is_file()
        if moved:
            self.path.replace(self.previous)
            logger.info("the earlier run's %s moved to %s.prev", METRICS_FILE, METRICS_FILE)
        if replaces_checkpoints:  # after the move: a marker means it happened
            self.unconfirmed_marker.touch()
        return moved

    def confirm(self) -> None:
        """This run wrote a checkpoint: the earlier run is gone, and so is the marker."""
        if self.rank == 0:
            self.unconfirmed_marker.unlink(missing_ok=True)

    def restore_earlier(self) -> None:
        """Undo `start` for a run from scratch that ends before its first checkpoint: the
        earlier run's metrics come back, this run's lines go to `.prev`."""
        if self.rank != 0:
            return
        path, previous = self.path, self.previous
        if path.is_file():
            swap = path.with_name(f".{path.name}.swap")
            path.replace(swap)
            if previous.is_file():
                previous.replace(path)
            swap.replace(previous)
        elif previous.is_file():  # this run logged nothing: only the earlier lines to put back
            previous.replace(path)
        self.unconfirmed_marker.unlink(missing_ok=True)

    def truncate_after(self, global_step: int) -> None:
        """Drop the lines an interrupted run wrote after the checkpoint at `global_step`.

        Train lines of steps >= g and validation lines after g were not kept by that checkpoint:
        the resumed run writes them again. Lines without a step stay; torn lines go.
        """
        if self.rank != 0 or not self.path.is_file():
            return
        kept = []
        for record in read_metrics(self.path):
            limit = global_step if record.train is not None else global_step + 1
            if record.step is None or record.step < limit:
                kept.append(record.to_line())
        atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
