"""The trainer benchmark's process handling (its GPU runs happen on the lent machines)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks.trainer_processes import run_process_group

# A parent that starts a child and waits: the shape of torchrun and its workers.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
child.wait()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a parent that is gone gets reaped by init; a zombie still answers.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_a_timed_out_run_leaves_no_worker_behind(tmp_path) -> None:
    log = tmp_path / "run.log"
    returncode, error = run_process_group(
        [sys.executable, "-c", PARENT], dict(os.environ), log, timeout=3
    )
    assert returncode is None and error == "timed out after 3 s"
    child = int(log.read_text().split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_finished_run_gives_its_exit_status(tmp_path) -> None:
    log = tmp_path / "run.log"
    assert run_process_group(
        [sys.executable, "-c", "print('done'); raise SystemExit(3)"],
        dict(os.environ),
        log,
        timeout=30,
    ) == (3, None)
    assert log.read_text().strip() == "done"


def test_runs_start_in_the_benchmarked_checkout(tmp_path, monkeypatch) -> None:
    # `python -m speculators_vllm016` imports the package of the working folder first: a run
    # started elsewhere would benchmark that folder's code, not ROOT's.
    from benchmarks import trainer_gpu

    monkeypatch.chdir(tmp_path)
    log = tmp_path / "run.log"
    returncode, _, _ = trainer_gpu._launch(
        [sys.executable, "-c", "import os; print(os.getcwd())"], "ddp", log, 30
    )
    assert returncode == 0
    assert log.read_text().strip() == str(trainer_gpu.ROOT)


@pytest.mark.slow
def test_resume_check_times_checkpoints_and_finds_the_resumed_run_equal(tmp_path) -> None:
    # The real trainer on the CPU preset: an uninterrupted run, half of it then resumed, and a
    # repeat; on the CPU all three end with the same weights, bit for bit.
    from benchmarks.trainer_gpu import main

    result = main(
        [
            "--preset",
            "cpu-small",
            "--runs",
            "single",
            "--max-steps",
            "2",
            "--warmup-steps",
            "0",
            "--total-seq-len",
            "512",
            "--samples",
            "8",
            "--device",
            "cpu",
            "--run-timeout",
            "300",
            "--work-dir",
            str(tmp_path / "work"),
            "--output-dir",
            str(tmp_path / "out"),
            "--resume-check",
        ]
    )
    run = result["runs"][0]
    assert run["error"] is None and run["returncode"] == 0
    assert run["checkpoint_save_seconds"] > 0 and run["checkpoint_load_seconds"] > 0
    assert run["resumed_equal"] is True and run["resumed_max_abs_diff"] == 0
    assert run["repeat_equal"] is True
    assert "equal, bit for bit" in (tmp_path / "out" / "trainer-cpu-small.md").read_text()


def test_a_run_that_exited_non_zero_fails_the_benchmark():
    """A trainer that stopped (exit 2 on a machine without vLLM) used to leave the script at
    exit 0 with an empty row; the failed run is named so the script exits 1."""
    from benchmarks.trainer_gpu import failed_runs

    result = {
        "runs": [
            {"name": "baseline", "returncode": 0, "error": None},
            {"name": "single", "returncode": 2, "error": "exit 2: No module named 'vllm'"},
            {"name": "timeout", "returncode": None, "error": "timed out after 240 s"},
        ]
    }
    assert failed_runs(result) == [
        "single: exit 2: No module named 'vllm'",
        "timeout: timed out after 240 s",
    ]
    assert failed_runs({"runs": [{"name": "single", "returncode": 0, "error": None}]}) == []
