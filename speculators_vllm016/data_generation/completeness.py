"""Whether a datagen folder holds every sample its run lists: training must not start on less.

A datagen folder says which samples it should hold in two places: the run record
(`.datagen_state.json`: the first file index, the format and, since this check, the number of
samples) and the manifests (every file that was once whole). A run stopped half-way, a shard not
yet run, or files lost in a copy leave some of them absent, and training on the rest would look
like success. Older records without the count fall back to `data_config.json`'s `num_samples`,
which datagen writes when a shard finishes. A folder without record and manifest (0.3.0's layout)
lists nothing and is never refused.

No engine module is imported: the trainer calls this where vLLM is absent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from speculators_vllm016.data_generation.config_generator import CONFIG_FILE
from speculators_vllm016.data_generation.manifest import read_manifest
from speculators_vllm016.data_generation.resume import STATE_FILE
from speculators_vllm016.data_generation.sample_io import SAMPLE_FILE, SAMPLE_PATTERNS

__all__ = ["MissingSamples", "expected_sample_names", "missing_samples"]

SHOWN = 5  # missing names quoted in the message


@dataclass(frozen=True)
class MissingSamples:
    """Sample files a datagen folder's run lists but the folder lacks."""

    folder: Path
    missing: list[str]  # in index order
    listed: int  # how many the run lists in all

    def message(self) -> str:
        shown = ", ".join(self.missing[:SHOWN])
        more = f" and {len(self.missing) - SHOWN} more" if len(self.missing) > SHOWN else ""
        return (
            f"{self.folder} lacks {len(self.missing)} of the {self.listed} sample files its "
            f"datagen run lists ({shown}{more}); finish them by running the same `speculators "
            "datagen` command again (every --shard-index of a sharded job), then train"
        )


def _json_object(path: Path) -> dict | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _recorded_count(folder: Path, record: dict) -> int | None:
    """Samples of the whole run: the record's count, else data_config.json's (older records)."""
    count = record.get("details", {}).get("num_samples")
    if count is None:
        config = _json_object(folder / CONFIG_FILE) or {}
        count = (config.get("data") or {}).get("num_samples")
    try:
        return None if count is None else max(int(count), 0)
    except (TypeError, ValueError):
        return None


def expected_sample_names(folder: str | os.PathLike) -> set[str]:
    """Names of every sample file the folder's run record and manifests list (empty: no list)."""
    folder = Path(folder)
    names = set(read_manifest(folder))
    record = _json_object(folder / STATE_FILE)
    if record is not None:
        count = _recorded_count(folder, record)
        pattern = SAMPLE_PATTERNS.get(record.get("output_format", "pt"))
        if count is not None and pattern is not None:
            start = int(record.get("start_idx", 0) or 0)
            names.update(pattern.format(idx=start + position) for position in range(count))
    return names


def _index(name: str) -> tuple[int, str]:
    match = SAMPLE_FILE.match(name)
    return (int(match.group(1)), name) if match else (-1, name)


def missing_samples(
    folder: str | os.PathLike, present: Iterable[str] | None = None
) -> MissingSamples | None:
    """What the run of `folder` lists but the folder lacks; None when nothing is missing.

    `present` are the sample file names found there (listed anew when not given).
    """
    folder = Path(folder)
    expected = expected_sample_names(folder)
    if not expected:
        return None
    if present is None:
        present = [name for name in os.listdir(folder) if SAMPLE_FILE.match(name)]
    missing = sorted(expected - set(present), key=_index)
    if not missing:
        return None
    return MissingSamples(folder=folder, missing=missing, listed=len(expected))
