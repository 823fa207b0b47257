"""tau_sim: the trainer's cheap acceptance estimate, read back beside a measured tau.

The trainer logs per TTT step k the validation accuracy `full_acc_k` (the draft right at steps
0..k, teacher-forced on the verifier's data). tau_sim = 1 + sum_k full_acc_k is what tau would be
if acceptance on generated text matched those figures; showing both tells users how far the
estimate is from the measured value.

Metrics are read from `metrics.jsonl` in the draft folder or the folder above it
(`<save>/metrics.jsonl` for a checkpoint `<save>/<epoch>/`) with `train.metrics_log.read_metrics`,
whose module documents the record schema; the trainer writes its validation means as
`{"step": s, "val": {"full_acc_0_epoch": ...}, "epoch": e}`. The formula, `simulated_tau`, lives
there too. Nested keys are joined with "/"; a line counts when it holds `full_acc_<k>` keys,
plain or with a `val/` or `val_` prefix and an optional `_epoch` suffix; lines with validation keys win over lines without. For
an epoch folder the line whose `epoch` matches is used, otherwise the last one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from speculators_vllm016.train.logger import METRICS_FILE
from speculators_vllm016.train.metrics_log import MetricsRecord, read_metrics, simulated_tau

__all__ = ["TrainingEstimate", "find_training_estimate"]

_KEY = re.compile(r"^(?P<val>val[/_])?full_acc_(?P<step>\d+)(?:_epoch)?$")


@dataclass
class TrainingEstimate:
    """tau_sim and where it came from."""

    tau_sim: float
    full_acc: list[float]
    source: str
    epoch: int | None


def _accuracies(record: MetricsRecord) -> tuple[bool, list[float]] | None:
    by_step: dict[int, float] = {}
    validation = False
    for key, value in record.flat().items():
        match = _KEY.match(key)
        if match is None or not isinstance(value, (int, float)):
            continue
        if match["val"]:
            validation = True
        by_step[int(match["step"])] = float(value)
    if not by_step or sorted(by_step) != list(range(len(by_step))):
        return None
    return validation, [by_step[step] for step in range(len(by_step))]


def find_training_estimate(draft_path: str | Path) -> TrainingEstimate | None:
    """tau_sim of the draft at `draft_path` from the trainer's metrics, or None when none apply."""
    folder = Path(draft_path).resolve()  # `<save>/best` links to an epoch folder
    epoch = int(folder.name) if folder.name.isdigit() else None
    for candidate in (folder / METRICS_FILE, folder.parent / METRICS_FILE):
        if not candidate.is_file():
            continue
        scored = []
        for record in read_metrics(candidate):
            found = _accuracies(record)
            if found is not None:
                scored.append((record, *found))
        if any(validation for _, validation, _ in scored):
            scored = [entry for entry in scored if entry[1]]
        if epoch is not None and candidate.parent != folder:
            scored = [entry for entry in scored if entry[0].epoch == epoch]
        if not scored:
            continue
        record, _, accuracies = scored[-1]
        return TrainingEstimate(
            tau_sim=simulated_tau(accuracies),
            full_acc=accuracies,
            source=str(candidate),
            epoch=record.epoch,
        )
    return None
