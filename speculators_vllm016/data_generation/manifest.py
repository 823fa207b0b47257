"""The lengths index of a datagen folder: one JSON line per whole sample file.

Datagen appends a record once a sample is under its final name (after the rename), to a manifest
file of its own shard (`manifest/shard-{I}-of-{N}.jsonl`), so concurrent shards never write the
same file. A crash can leave a torn last line; readers skip it. A later record for the same file
wins (a recomputed file gets a new record). The trainer reads lengths from here instead of
guessing them from file sizes, and a resumed run uses sizes to check present files cheaply.

Only the standard library is imported: the trainer reads this where vLLM is absent.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from speculators_vllm016.utils.json_lines import JsonLinesAppender

__all__ = [
    "MANIFEST_DIR",
    "ManifestWriter",
    "SampleRecord",
    "manifest_path",
    "read_manifest",
]

MANIFEST_DIR = "manifest"


@dataclass(frozen=True)
class SampleRecord:
    """One whole sample file: its name, global index, token count, size and content hash."""

    file: str
    index: int
    length: int
    bytes: int
    sha256: str | None


def manifest_path(data_dir: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    return Path(data_dir) / MANIFEST_DIR / f"shard-{shard_index}-of-{num_shards}.jsonl"


def _parse(line: str) -> SampleRecord | None:
    try:
        raw = json.loads(line)
        return SampleRecord(
            file=str(raw["file"]),
            index=int(raw["index"]),
            length=int(raw["length"]),
            bytes=int(raw["bytes"]),
            sha256=raw.get("sha256"),
        )
    except (ValueError, KeyError, TypeError):
        return None  # a torn line from a crash, or not ours


def read_manifest(data_dir: str | os.PathLike) -> dict[str, SampleRecord]:
    """Every record of every manifest file in `data_dir`, keyed by file name ("data_12.pt").

    Files are read in name order and lines in file order; later records for a file win. Records
    are not checked against the files: a reader that needs that compares `bytes` with the size.
    """
    folder = Path(data_dir) / MANIFEST_DIR
    records: dict[str, SampleRecord] = {}
    if not folder.is_dir():
        return records
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                record = _parse(line) if line.endswith("\n") else None
                if record is not None:
                    records[record.file] = record
    return records


class ManifestWriter(JsonLinesAppender):
    """Appends records to one shard's manifest, one flushed line each (thread-safe appends).

    A torn last line left by a crash is ended with a newline first, so the next record starts on
    a line of its own.
    """

    def append(self, record: SampleRecord) -> None:  # type: ignore[override]
        super().append(asdict(record))

    def __enter__(self) -> ManifestWriter:
        return self
