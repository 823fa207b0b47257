"""The failures a training run reports to its user, each one line that says why and what to do.

`TrainingError` is their common class: a command that runs the trainer prints its message as
its one error line (no traceback). Each subclass is one kind of failure a caller may want to
tell apart.
"""

from __future__ import annotations

from speculators_vllm016.utils.errors import RunFailedError

__all__ = [
    "CheckpointReadError",
    "CheckpointWriteError",
    "NothingTrained",
    "SavePathInUse",
    "TrainingError",
]


class TrainingError(RunFailedError):
    """A run cannot go on; the message is one line saying why and what to do."""


class NothingTrained(TrainingError):
    """A run or an epoch whose steps had no token to learn from: nothing is saved."""


class SavePathInUse(TrainingError):
    """Another live process trains into the same save path."""


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (a full disk, most often); the earlier ones stay."""


class CheckpointReadError(TrainingError):
    """A checkpoint file to resume from is damaged or not what the trainer writes."""
