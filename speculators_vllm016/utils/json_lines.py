"""Append-only JSON-lines logs that survive a crash: each record is one flushed line.

A process killed mid-write leaves at most a torn last line. Readers skip a line without its
newline or that does not parse, and a new appender first ends such a line, so the next record
starts on a line of its own. Datagen's manifest and regeneration's finished-row log both write
through here. Only the standard library is imported (the trainer reads manifests without vLLM).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["JsonLinesAppender", "read_json_lines"]


def read_json_lines(path: str | os.PathLike) -> Iterator[Any]:
    """The whole records of `path` in file order (torn or unreadable lines skipped)."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                continue  # torn by a crash
            try:
                yield json.loads(line)
            except ValueError:
                continue


class JsonLinesAppender:
    """Appends one JSON record per line to `path`, flushed (and fsynced with `fsync`) each time.

    Appends from several threads are serialized; a torn last line left by a crash is ended first.
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - open while the log lives
        self._handle.seek(0, os.SEEK_END)
        if self._handle.tell() > 0:
            self._handle.seek(self._handle.tell() - 1)
            if self._handle.read(1) != "\n":
                self._handle.write("\n")
                self._handle.flush()

    def append(self, record: Any) -> None:
        line = json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n"
        with self._lock:
            self._handle.write(line)
            self._handle.flush()
            if self.fsync:
                os.fsync(self._handle.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._handle.closed:
                self._handle.close()

    def __enter__(self) -> JsonLinesAppender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
