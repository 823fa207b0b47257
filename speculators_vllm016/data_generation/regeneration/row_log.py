"""A regeneration output folder: the job's record, the finished-row log, the final files.

    <dir>/regenerate_job.json              what the job is; a rerun must be the same job
    <dir>/.locks/shard-I-of-N.lock          held by the one process running shard I
    <dir>/rows/shard-I-of-N.jsonl           one line per finished chunk of rows, appended
    <dir>/conversations[.shard-I-of-N].jsonl  the regenerated rows in data order (datagen reads it)
    <dir>/failed[.shard-I-of-N].jsonl       rows not regenerated, each with the reason

A chunk of rows is logged in one flushed line once all its turns are done, so a killed run
leaves whole chunks or a torn last line (skipped when read). A rerun generates only the chunks
the log lacks (and the rows a server failed, which may succeed now). The final files are written under temporary names
and renamed, from the log, when every row of the shard is in it: an interrupted run and an
uninterrupted one write the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from speculators_vllm016.data_generation.output_folder import ShardLock
from speculators_vllm016.utils.atomic_files import atomic_write_json, atomic_write_text
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.json_lines import JsonLinesAppender, read_json_lines

__all__ = ["JOB_FILE", "RegenerationFolder", "output_file_names"]

JOB_FILE = "regenerate_job.json"
ROWS_DIR = "rows"


def output_file_names(shard_index: int, num_shards: int) -> tuple[str, str]:
    """(conversations file, failed-rows file) of a shard; unsharded: plain names."""
    suffix = "" if num_shards == 1 else f".shard-{shard_index}-of-{num_shards}"
    return f"conversations{suffix}.jsonl", f"failed{suffix}.jsonl"


class RegenerationFolder:
    """One shard's hold on a regeneration output folder (`--output-dir`)."""

    def __init__(self, path: str | os.PathLike, shard_index: int, num_shards: int, fsync: bool):
        self.path = Path(path)
        self.shard_index, self.num_shards, self.fsync = shard_index, num_shards, fsync
        self.conversations_name, self.failed_name = output_file_names(shard_index, num_shards)
        self.log_path = self.path / ROWS_DIR / f"shard-{shard_index}-of-{num_shards}.jsonl"
        self._lock: ShardLock | None = None
        self._log: JsonLinesAppender | None = None

    def check_job(self, job: dict[str, Any]) -> bool:
        """Refuse a folder of another job (or of something else); True when it has no record yet."""
        record = self.path / JOB_FILE
        if not record.exists():
            if self.path.is_dir() and any(
                name not in (ROWS_DIR, ".locks") for name in os.listdir(self.path)
            ):
                raise InvalidInputError(
                    f"--output-dir {self.path} holds files but no {JOB_FILE}; use an empty "
                    "or new --output-dir"
                )
            return True
        try:
            recorded = json.loads(record.read_text())
        except (OSError, ValueError):
            raise InvalidInputError(f"{record} is unreadable; use another --output-dir") from None
        differing = [
            f"{key}: was {recorded.get(key)!r}, now {value!r}"
            for key, value in job.items()
            if recorded.get(key) != value
        ]
        if differing:
            raise InvalidInputError(
                f"--output-dir {self.path} holds another regeneration job ("
                + "; ".join(differing)
                + "); use another --output-dir or the same flags"
            )
        return False

    def record_job(self, job: dict[str, Any]) -> None:
        """Write the record where there is none; one another shard wrote meanwhile must match."""
        record = self.path / JOB_FILE
        temp = atomic_write_json(record.with_name(f".{JOB_FILE}.{os.getpid()}.tmp"), job)
        try:
            os.link(temp, record)
        except FileExistsError:
            self.check_job(job)
        finally:
            temp.unlink(missing_ok=True)

    def lock(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = ShardLock(self.path, self.shard_index, self.num_shards)
        self._lock.__enter__()

    def _chunks(self) -> list[dict[str, Any]]:
        return [
            line
            for line in read_json_lines(self.log_path)
            if isinstance(line, dict) and isinstance(line.get("rows"), list)
        ]

    def logged_chunks(self) -> set[int]:
        """Numbers of the chunks whose line is in the log (whole)."""
        return {line["chunk"] for line in self._chunks() if isinstance(line.get("chunk"), int)}

    def finished_rows(self) -> dict[int, dict[str, Any]]:
        """The logged outcome of each finished row (a later line for a row wins: a retry)."""
        return {record["row"]: record for line in self._chunks() for record in line["rows"]}

    def log_chunk(self, number: int | None, records: list[dict[str, Any]]) -> None:
        """One line for a whole chunk: after a crash it is in the log whole, or not at all."""
        if self._log is None:
            self._log = JsonLinesAppender(self.log_path, fsync=self.fsync)
        self._log.append({"chunk": number, "rows": records})

    def write_outputs(self, rows: list[dict[str, Any]], failed: list[dict[str, Any]]) -> Path:
        """The shard's final files, each whole or absent; returns the conversations file."""
        target = self.path / self.conversations_name
        for path, lines in ((target, rows), (self.path / self.failed_name, failed)):
            text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
            atomic_write_text(path, text, fsync=self.fsync)
        return target

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __enter__(self) -> RegenerationFolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
