"""Whose folder a path is (datagen's, regenerate's, train's), from the files each command leaves
there: a command refuses an output folder another command wrote, in one line naming its flag,
before anything is written (it would mix its files into the other's: samples into regenerated
conversations, checkpoints into the samples).

The train names are `train.jobs.job_config.CONFIG_FILE` and `train.logger.METRICS_FILE` (train
is above this layer; `tests/data_generation/test_folder_kinds.py` keeps them equal).
"""

from __future__ import annotations

import os
from pathlib import Path

from speculators_vllm016.data_generation.config_generator import CONFIG_FILE as DATA_CONFIG
from speculators_vllm016.data_generation.manifest import MANIFEST_DIR
from speculators_vllm016.data_generation.regeneration.row_log import JOB_FILE, ROWS_DIR
from speculators_vllm016.data_generation.resume import STATE_FILE
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["MARKERS", "folder_kind", "refuse_other_command_folder"]

TRAIN_CONFIG_FILE = "train_config.yaml"
TRAIN_METRICS_FILE = "metrics.jsonl"

# Each command, and the names in its folder that only it writes.
MARKERS: dict[str, tuple[str, ...]] = {
    "datagen": (STATE_FILE, DATA_CONFIG, MANIFEST_DIR),
    "regenerate": (JOB_FILE, ROWS_DIR),
    "train": (TRAIN_CONFIG_FILE, TRAIN_METRICS_FILE),
}


def folder_kind(path: str | os.PathLike) -> tuple[str, str] | None:
    """(command, the file that shows it) of the folder `path`; None when no command's files
    are there (a new, empty or unrelated folder)."""
    path = Path(path)
    if not path.is_dir():
        return None
    for command, names in MARKERS.items():
        for name in names:
            if (path / name).exists():
                return command, name
    return None


def refuse_other_command_folder(path: str | os.PathLike, flag: str, command: str) -> None:
    """`path` (given as `flag` to `command`) must not be another command's folder."""
    found = folder_kind(path)
    if found is not None and found[0] != command:
        other, name = found
        raise InvalidInputError(
            f"{flag} {path} is a `speculators {other}` folder (it holds {name}); {command} "
            f"writes into a folder of its own: choose another {flag}"
        )
