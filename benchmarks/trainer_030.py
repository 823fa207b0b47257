"""speculators 0.3.0's own trainer (`scripts/train.py` of v0.3.0) on the benchmark's sample files.

`benchmarks/trainer_gpu.py --sustained --with-030 PATH` runs it after our runs, on the same files
and flags (verifier, data, d2t/t2d, `--total-seq-len`, `--epochs`), as 0.3.0 says to run it:
`torchrun --nproc-per-node 1 scripts/train.py ...` (under torchrun it trains through FSDP in bf16;
without it, in fp32). PATH is a copy of that script, or the folder holding it as
`speculators030_train.py` (or `train.py`, `scripts/train.py`); the `speculators` package it imports
must be 0.3.0's (its wheel installed ahead of this checkout on PYTHONPATH: this checkout's own
`speculators/` alias would otherwise shadow it; the launcher below drops the checkout from
sys.path and stops if it still finds the alias).

How 0.3.0 logs. Per step it logs one record on the `speculators.metrics` logger,
`{"train": {loss_k, full_acc_k, cond_acc_k, loss}, "epoch": e, "lr": lr}` with `extra={"step": n}`,
after the optimizer step and the metrics' `.item()` (so the GPU is done with the step). The record
itself carries no time and no token count. The metric backends (`--logger tensorboard|wandb|
trackio`) would stamp a wall time but need packages the GPU machine lacks, so none is used. The
console sees the records through a `rich.logging.RichHandler` on the root logger, stamped with
`datefmt="[%X]"`: whole seconds, and a time equal to the previous line's left blank; that is too
coarse for steps of ~0.4 s.

What we measure from. `torchrun` starts this file (`python benchmarks/trainer_030.py --records
FILE SCRIPT ARGS...`), which installs a `logging` record factory and then runs SCRIPT unmodified
with `runpy`: every record of the `speculators` loggers (rank 0, main process) is also written to
FILE as a JSON line `{"time": record.created, "logger": ..., "message": ...}` (the dict as
logged, or the formatted text); nothing else changes. A step's time is its record's creation time:
step k of an epoch lasts from the record of step k-1 to its own, the epoch's first step from the
`Training epoch N/M started` record (logged just before the epoch's loader iterator is made, as
our trainer's first step counts from its epoch start). Checkpoint writes: from `Started saving
checkpoint` to `Finished saving checkpoint`. Without FILE (a run not started through this
launcher), `parse_console` reads the console's `[HH:MM:SS]` lines: epoch figures to the second,
no per-step figures.

Tokens per step. 0.3.0 reports none. Its rows: each sample loses its first token (`shift_batch`),
`MultipackDistributedBatchSamplerV2` packs whole samples up to `--total-seq-len`, the row is padded
to `--total-seq-len`; it trains `int(0.9 * files)` files per epoch (`split_files`, ratio 0.9,
fixed; the rest is its validation pass after each epoch). With equal samples every row but an
epoch's last holds `total_seq_len // (sample_tokens - 1)` samples: `packing_030` gives the real
tokens per row (as our trainer's `train/tokens` counts them) and per epoch; the last step of an
epoch gets the remainder. Rates leave out the run's first step (compilation), like ours.
0.3.0 has no data-wait figure (`max_data_wait_seconds` is None), no `--num-workers` (12 loader
processes for training and 12 for validation, hard-coded) and no max-steps.
"""

from __future__ import annotations

# The launcher runs this file before 0.3.0's script: stdlib imports only at the top.
import json
import logging
import math
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "NAME",
    "command_030",
    "find_train_script",
    "packing_030",
    "parse_console",
    "read_records",
    "run_030",
    "summarize_030",
]

NAME = "speculators-0.3.0"
ROOT = Path(__file__).resolve().parent.parent
SCRIPT_NAMES = ("speculators030_train.py", "train.py", "scripts/train.py")
TRAIN_RATIO = 0.9  # split_files(args.data_path, ratio=0.9) in 0.3.0's train.py

_EPOCH = re.compile(r"(Training|Validation) epoch (\d+)/(\d+) (started|completed)")
_SAVE = re.compile(r"(Started|Finished) saving checkpoint to")
_CONSOLE_TIME = re.compile(r"^\[(\d\d):(\d\d):(\d\d)\]")


# -- the command ---------------------------------------------------------------------------------
def find_train_script(path: str | os.PathLike) -> Path | None:
    """0.3.0's train.py, absolute (the run starts in its own folder): `path` itself, or a known
    name inside the folder `path`."""
    path = Path(path).resolve()
    if path.is_file():
        return path
    return next((path / name for name in SCRIPT_NAMES if (path / name).is_file()), None)


def command_030(
    train_script: Path,
    paths: Mapping[str, Path],
    save: Path,
    total_seq_len: int,
    epochs: int,
    records: Path | None = None,
    lr: float | None = None,
    python: str = sys.executable,
    extra: Iterable[str] = (),
) -> list[str]:
    """`torchrun --standalone --nproc-per-node 1` of 0.3.0's train.py on `write_synthetic_inputs`'
    paths (verifier, data, d2t, t2d), through this file's launcher when `records` is given."""
    flags = [
        "--verifier-name-or-path",
        str(paths["verifier"]),
        "--data-path",
        str(paths["data"]),
        "--save-path",
        str(save),
        "--log-dir",
        str(save.parent / "logs"),
        "--d2t-path",
        str(paths["d2t"]),
        "--t2d-path",
        str(paths["t2d"]),
        "--total-seq-len",
        str(total_seq_len),
        "--epochs",
        str(epochs),
        "--data-format-version",
        "1",
        "--no-resume-from-checkpoint",
    ]
    if lr is not None:
        flags += ["--lr", str(lr)]
    flags += list(extra)
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    if records is None:
        return [*torchrun, str(train_script), *flags]
    return [
        *torchrun,
        str(Path(__file__).resolve()),
        "--records",
        str(records),
        str(train_script),
        *flags,
    ]


def packing_030(total_seq_len: int, sample_tokens: int, samples: int) -> dict[str, int]:
    """0.3.0's rows on `samples` files of `sample_tokens` tokens: real tokens per full row, per
    epoch (its training files), rows per epoch."""
    shifted = sample_tokens - 1  # shift_batch drops each sample's first token
    per_row = max(1, total_seq_len // shifted)
    train_files = int(samples * TRAIN_RATIO)
    return {
        "samples_per_row": per_row,
        "tokens_per_step": min(per_row * shifted, total_seq_len),
        "train_files": train_files,
        "epoch_tokens": train_files * min(shifted, total_seq_len),
        "steps_per_epoch": math.ceil(train_files / per_row),
    }


# -- reading its output ----------------------------------------------------------------------------
def read_records(path: Path) -> list[dict[str, Any]]:
    """The launcher's JSON lines (a torn last line, from a killed run, is skipped)."""
    records = []
    if not path.is_file():
        return records
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def parse_console(text: str) -> list[dict[str, Any]]:
    """Records from 0.3.0's console: `[HH:MM:SS]` (a blank time repeats the last one; past
    midnight the clock goes on), epoch and checkpoint lines, and one train record per metric line
    (`train/...=` at the start of a logged message). Times are whole seconds."""
    records: list[dict[str, Any]] = []
    clock, days, epoch = None, 0, None
    for line in text.splitlines():
        stamp = _CONSOLE_TIME.match(line)
        if stamp:
            seconds = int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3])
            if clock is not None and seconds < clock:
                days += 1
            clock = seconds
        if clock is None:
            continue
        now = clock + 86400 * days
        event = _EPOCH.search(line)
        if event:
            if event[1] == "Training":
                epoch = int(event[2]) - 1
            records.append({"time": float(now), "logger": "console", "message": event[0]})
        elif _SAVE.search(line):
            records.append(
                {"time": float(now), "logger": "console", "message": _SAVE.search(line)[0]}
            )
        elif re.search(r"INFO\s+train/\S+=", line):
            records.append(
                {"time": float(now), "logger": "console", "message": {"train": {}, "epoch": epoch}}
            )
    return records


def summarize_030(
    records: list[dict[str, Any]],
    tokens_per_step: float,
    epoch_tokens: float | None = None,
    per_step: bool = True,
) -> dict[str, Any]:
    """Our runs' shape from 0.3.0's records: per epoch tokens/s (its step intervals, the run's
    first step left out), the first step's seconds, validation seconds; the run's median, min and
    max step rates (`per_step=False`, for whole-second times: epoch figures only) and its
    checkpoint writes."""
    steps: list[tuple[float, int | None, Mapping[str, Any]]] = []
    starts: dict[int, float] = {}
    validation: dict[int, dict[str, float]] = {}
    saves: list[float] = []
    save_started = None
    for record in records:
        moment, message = float(record["time"]), record.get("message")
        if isinstance(message, Mapping):
            if isinstance(message.get("train"), Mapping):
                steps.append((moment, message.get("epoch"), message["train"]))
            continue
        text = str(message)
        event = _EPOCH.search(text)
        if event:
            epoch = int(event[2]) - 1
            if event[1] == "Training" and event[4] == "started":
                starts[epoch] = moment
            elif event[1] == "Validation":
                validation.setdefault(epoch, {})[event[4]] = moment
            continue
        save = _SAVE.search(text)
        if save and save[1] == "Started":
            save_started = moment
        elif save and save_started is not None:
            saves.append(round(moment - save_started, 3))
            save_started = None

    epochs: list[dict[str, Any]] = []
    rates: list[float] = []
    step_seconds: list[float] = []
    total_tokens = total_seconds = 0.0
    known_epochs = sorted({epoch for _, epoch, _ in steps if epoch is not None})
    for epoch in known_epochs:
        times = [moment for moment, e, _ in steps if e == epoch]
        start = starts.get(epoch)
        durations: list[float | None] = [None if start is None else times[0] - start]
        durations += [later - earlier for earlier, later in zip(times, times[1:])]
        tokens = [float(tokens_per_step)] * len(times)
        if epoch_tokens is not None:
            rest = epoch_tokens - tokens_per_step * (len(times) - 1)
            if 0 < rest <= tokens_per_step:
                tokens[-1] = float(rest)
        timed = [
            i
            for i, spent in enumerate(durations)
            if spent is not None and not (epoch == known_epochs[0] and i == 0)
        ]
        epoch_spent = sum(durations[i] for i in timed)  # type: ignore[misc]
        epoch_count = sum(tokens[i] for i in timed)
        total_tokens, total_seconds = total_tokens + epoch_count, total_seconds + epoch_spent
        for i in timed:
            if durations[i] > 0:  # type: ignore[operator]
                rates.append(tokens[i] / durations[i])  # type: ignore[operator]
                step_seconds.append(durations[i])  # type: ignore[arg-type]
        checked = validation.get(epoch, {})
        epochs.append(
            {
                "epoch": epoch,
                "steps": len(times),
                "tokens_per_second": round(epoch_count / epoch_spent, 1)
                if epoch_spent > 0
                else None,
                "max_data_wait_seconds": None,
                "first_step_seconds": None if durations[0] is None else round(durations[0], 4),
                "seconds": None if start is None else round(times[-1] - start, 3),
                "validation_seconds": (
                    round(checked["completed"] - checked["started"], 3)
                    if {"started", "completed"} <= checked.keys()
                    else None
                ),
            }
        )
    losses = [train.get("loss") for _, _, train in steps if train.get("loss") is not None]
    summary: dict[str, Any] = {
        "steps_logged": len(steps),
        "timed_steps": len(rates) if per_step else 0,
        "tokens_per_step": float(tokens_per_step),
        "median_tokens_per_second": None,
        "min_tokens_per_second": None,
        "max_tokens_per_second": None,
        "spread_percent": None,
        "aggregate_tokens_per_second": (
            round(total_tokens / total_seconds, 1) if total_seconds > 0 else None
        ),
        "median_step_seconds": None,
        "median_step_tokens_per_second": None,
        "peak_memory_gib": None,
        "final_loss": losses[-1] if losses else None,
        "checkpoint_save_seconds": saves[-1] if saves else None,
        "checkpoint_save_seconds_each": saves or None,
        "epochs": epochs,
    }
    if per_step and rates:
        median = statistics.median(rates)
        summary.update(
            median_tokens_per_second=round(median, 1),
            median_step_tokens_per_second=round(median, 1),
            min_tokens_per_second=round(min(rates), 1),
            max_tokens_per_second=round(max(rates), 1),
            spread_percent=round(100 * (max(rates) - min(rates)) / median, 2),
            median_step_seconds=round(statistics.median(step_seconds), 5),
        )
    return summary


def markdown_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The report's lines on the 0.3.0 run: how it was measured, and ours / 0.3.0 for the median
    step and each epoch (our first run with per-epoch figures). Nothing without a 0.3.0 run."""
    reference = next((run for run in runs if run.get("name") == NAME), None)
    if reference is None:
        return []
    packing = reference.get("packing") or {}
    lines = [
        "",
        f"`{NAME}`: v0.3.0's `scripts/train.py`, unmodified, under `torchrun "
        "--nproc-per-node 1` (FSDP, bf16) on the same files and flags; tokens/s from the "
        f"interval between its per-step metric records ({reference.get('timing')}), "
        f"{packing.get('tokens_per_step', '?')} real tokens per row of "
        f"{packing.get('samples_per_row', '?')} samples (0.3.0 logs no count); each epoch trains "
        f"{packing.get('train_files', '?')} files (its fixed 90% split) and ends with its "
        "validation pass; it has no data-wait figure.",
    ]
    if reference.get("error"):
        lines.append(f"0.3.0's run: {reference['error']}")
    ours = next((run for run in runs if run.get("name") != NAME and run.get("epochs")), None)
    if ours is None:
        return lines

    def ratio(mine: float | None, theirs: float | None) -> str:
        return f"{mine / theirs:.2f}x" if mine and theirs else "n/a"

    ours_median = ours.get("median_step_tokens_per_second")
    theirs_median = reference.get("median_step_tokens_per_second")
    theirs = {
        epoch["epoch"]: epoch.get("tokens_per_second") for epoch in reference.get("epochs") or []
    }
    each = ", ".join(
        f"{epoch['epoch']}: {ratio(epoch.get('tokens_per_second'), theirs.get(epoch['epoch']))}"
        for epoch in ours["epochs"]
    )
    lines += [
        "",
        f"Ours (`{ours['name']}`) / 0.3.0: median step {ratio(ours_median, theirs_median)} "
        f"({ours_median or 0:,.0f} / {theirs_median or 0:,.0f} tokens/s); per epoch: {each}",
    ]
    return lines


# -- the run -------------------------------------------------------------------------------------
def run_030(
    train_script: str | os.PathLike | None,
    paths: Mapping[str, Path],
    work: Path,
    *,
    total_seq_len: int,
    epochs: int,
    sample_tokens: int,
    samples: int,
    timeout: float,
    keep_checkpoints: int | None = None,
) -> dict[str, Any]:
    """Run 0.3.0's trainer on `paths` (GPU 0 unless CUDA_VISIBLE_DEVICES says otherwise) and
    summarize it like our runs: a dict with RunResult's keys, `name` "speculators-0.3.0"."""
    import shutil

    from benchmarks.trainer_processes import SAFE_ENV, checkpoint_pruning, run_process_group

    folder = work / "run-030"
    save, records, log = folder / "checkpoints", folder / "records.jsonl", work / "run-030.log"
    script = find_train_script(train_script) if train_script else None
    packing = packing_030(total_seq_len, sample_tokens, samples)
    result: dict[str, Any] = {
        "name": NAME,
        "processes": 1,
        "command": "",
        "returncode": None,
        "seconds": 0.0,
        "packing": packing,
        "timing": None,
        "error": None,
    }
    if script is None:
        result["error"] = f"0.3.0's train.py not found at {train_script}"
        result.update(summarize_030([], packing["tokens_per_step"]))
        return result
    shutil.rmtree(folder, ignore_errors=True)  # no stale checkpoint or records
    folder.mkdir(parents=True)
    command = command_030(script, paths, save, total_seq_len, epochs, records=records)
    result["command"] = shlex.join(command)
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    # This checkout's `speculators/` is an alias of ours: keep it off 0.3.0's path.
    env["PYTHONPATH"] = os.pathsep.join(
        entry
        for entry in env.get("PYTHONPATH", "").split(os.pathsep)
        if entry and Path(entry).resolve() != ROOT
    )
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    print(f"$ {result['command']}", flush=True)
    started = time.perf_counter()
    with checkpoint_pruning(save, keep_checkpoints):
        returncode, error = run_process_group(command, env, log, timeout, cwd=folder)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["returncode"] = returncode
    text = log.read_text(errors="replace") if log.is_file() else ""
    if returncode not in (0, None):
        tail = text.strip().splitlines()[-25:]
        print("\n".join(tail), flush=True)
        error = f"exit {returncode}: " + (tail[-1][:300] if tail else "")
    result["error"] = error
    found, exact = read_records(records), True
    if not found:  # not started through the launcher: the console's whole seconds
        found, exact = parse_console(text), False
    result["timing"] = "log record times" if exact else "console times, whole seconds"
    result.update(
        summarize_030(found, packing["tokens_per_step"], packing["epoch_tokens"], per_step=exact)
    )
    print(json.dumps(result), flush=True)
    return result


# -- the launcher (torchrun runs this file) ------------------------------------------------------
def _plain(record: logging.LogRecord) -> Any:
    if isinstance(record.msg, Mapping):
        return json.loads(json.dumps(record.msg, default=repr))
    try:
        return record.getMessage()
    except Exception:  # noqa: BLE001 - a badly formatted message is still a record
        return str(record.msg)


def install_record_capture(path: Path) -> None:
    """Also write every record of the `speculators` loggers as a JSON line with its time."""
    if os.environ.get("RANK", "0") != "0":
        return
    handle = open(path, "a", buffering=1)  # noqa: SIM115 - open while the process lives
    owner = os.getpid()  # not the loader's forked workers
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if os.getpid() == owner and (
            record.name == "speculators" or record.name.startswith("speculators.")
        ):
            handle.write(
                json.dumps(
                    {"time": record.created, "logger": record.name, "message": _plain(record)}
                )
                + "\n"
            )
        return record

    logging.setLogRecordFactory(factory)


def launch(argv: list[str]) -> None:
    """`--records FILE SCRIPT ARGS...`: run SCRIPT as `python SCRIPT ARGS...` would, records on."""
    if len(argv) < 3 or argv[0] != "--records":
        raise SystemExit("usage: trainer_030.py --records FILE SCRIPT [ARGS...]")
    records, script, rest = Path(argv[1]), Path(argv[2]).resolve(), argv[3:]
    sys.path[:] = [str(script.parent)] + [
        entry for entry in sys.path[1:] if entry and Path(entry).resolve() != ROOT
    ]
    import importlib.metadata
    import importlib.util
    import runpy

    spec = importlib.util.find_spec("speculators")
    where = Path(spec.origin).resolve().parent if spec and spec.origin else None
    try:
        version = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        version = None
    # A checkout of ours (this one, or one installed in editable mode) serves `speculators` as an
    # alias of `speculators_vllm016`, beside it.
    if where is None or version is None or (where.parent / "speculators_vllm016").is_dir():
        raise SystemExit(
            f"no speculators 0.3.0 package to run: `speculators` at {where}, "
            f"installed version {version} (install its wheel ahead on PYTHONPATH)"
        )
    print(
        f"trainer_030 launcher: speculators {version} from {where}; records to {records}",
        flush=True,
    )
    install_record_capture(records)
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    launch(sys.argv[1:])
