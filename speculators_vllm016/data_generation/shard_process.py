"""One attempt at one shard of a datagen job, as a process of its own with its output in a log.

This is what a Ray task of `speculators datagen --ray-address` runs on its node: the ordinary
`python -m speculators_vllm016 datagen` command with the job's flags and this shard's
`--shard-index`, so a shard on Ray behaves exactly like a shard started by hand (same folder
protocol, same resume). Its exit status says what a retry can do: 0 is done, 2 is a mistake in the
flags, the model or the data (the same run would fail the same way), anything else (a crash, a
kill, a lost node) leaves a folder that a retry resumes.

The shard runs in a session of its own and its whole group is killed when it ends or when its task
is cancelled, so engine processes a killed shard leaves behind never hold a GPU into the retry.
(A task whose worker dies takes the shard with it: Ray kills a dead worker's child processes.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.utils.command_errors import DEBUG_HINT, EXIT_ERROR

__all__ = [
    "LOG_DIR",
    "AttemptResult",
    "run_shard_attempt",
    "shard_arguments",
    "shard_log_path",
]

LOG_DIR = "logs"
SUMMARY_PREFIX = "SUMMARY "  # the line `speculators datagen` ends a finished run with
ERROR_PREFIX = "error: "  # the line it prints for an expected failure
WAIT_STEP_SECONDS = 1.0


def shard_log_path(output_dir: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    """Where every attempt of one shard writes its output (appended, attempt after attempt)."""
    return Path(output_dir) / LOG_DIR / f"shard-{shard_index}-of-{num_shards}.log"


def shard_arguments(options: DatagenOptions, shard_index: int, verbose: bool = False) -> list[str]:
    """The `speculators datagen` flags of shard `shard_index` of the job `options` describe.

    Every option becomes its flag (`show_progress` becomes `--no-progress`: the driver draws the
    one bar); values are written `--flag=value`, so a value that starts with a dash stays a value.
    """
    arguments: list[str] = []
    for part in (options.engine, options.preprocessing, options.output):
        for item in fields(part):
            name, value = item.name, getattr(part, item.name)
            if name == "shard_index":
                value = shard_index
            if name == "show_progress":
                continue
            flag = "--" + name.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                arguments.append(flag)
            elif isinstance(value, (list, tuple)):
                arguments += [flag, *(str(element) for element in value)]
            else:
                arguments.append(f"{flag}={value}")
    arguments.append("--no-progress")
    if verbose:
        arguments.append("--verbose")
    return arguments


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt at a shard ended, as the driver needs it to decide on a retry."""

    shard_index: int
    attempt: int  # 1 for the first run of the shard
    returncode: int | None  # the shard process's; None when its Ray task itself was lost
    host: str
    summary: dict | None = None  # the shard's SUMMARY line, when it finished
    error: str | None = None  # its own one-line error, or why the task was lost

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def retryable(self) -> bool:
        """A mistake in the flags or data (exit 2) fails every attempt the same way."""
        return not self.ok and self.returncode != EXIT_ERROR

    def why(self) -> str:
        """How the attempt ended, in words."""
        if self.returncode is None:
            return f"its Ray task was lost ({self.error})"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        if self.error:
            return self.error
        return f"exit status {self.returncode}"


def _attempt_output(log_path: Path, offset: int) -> list[str]:
    with open(log_path, encoding="utf-8", errors="replace") as log:
        log.seek(offset)
        return log.read().splitlines()


def _summary_and_error(lines: list[str]) -> tuple[dict | None, str | None]:
    """The shard's SUMMARY (a finished run) and its last one-line error, from its output."""
    import json

    summary, error = None, None
    for line in lines:
        if line.startswith(SUMMARY_PREFIX):
            try:
                summary = json.loads(line[len(SUMMARY_PREFIX) :])
            except ValueError:
                summary = None
        elif line.startswith(ERROR_PREFIX):
            error = line[len(ERROR_PREFIX) :].removesuffix(DEBUG_HINT).strip()
    return summary, error


def run_shard_attempt(
    shard_index: int, attempt: int, arguments: list[str], log_path: str, cwd: str
) -> AttemptResult:
    """Run `speculators datagen ARGUMENTS` once, its output appended to `log_path`.

    `cwd` is the driver's working directory (relative paths in the flags are meant from there);
    a node without it runs in its own.
    """
    host = socket.gethostname()
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "speculators_vllm016", "datagen", *arguments]
    with open(path, "a", encoding="utf-8") as log:
        offset = log.tell()
        log.write(
            f"=== shard {shard_index}, attempt {attempt}, on {host}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n"
        )
        log.flush()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd if os.path.isdir(cwd) else None,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        try:
            # Waiting in steps lets a cancelled task's interrupt through (then the group is killed).
            returncode = None
            while returncode is None:
                try:
                    returncode = process.wait(timeout=WAIT_STEP_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            _kill_group(process)
        log.write(f"=== shard {shard_index}, attempt {attempt}: exit status {returncode} ===\n")
    summary, error = _summary_and_error(_attempt_output(path, offset))
    return AttemptResult(shard_index, attempt, returncode, host, summary, error)


def _kill_group(process: subprocess.Popen[Any]) -> None:
    """What the shard left running (engine workers of a killed shard) goes with it."""
    if process.poll() is None:
        process.kill()
        process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
