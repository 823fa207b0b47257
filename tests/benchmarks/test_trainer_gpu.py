"""The trainer benchmark's process handling (its GPU runs happen on the lent machines)."""

from __future__ import annotations

import os
import sys
import time

from benchmarks.trainer_gpu import run_process_group

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
    returncode, error = run_process_group([sys.executable, "-c", PARENT], dict(os.environ), log,
                                          timeout=3)
    assert returncode is None and error == "timed out after 3 s"
    child = int(log.read_text().split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_finished_run_gives_its_exit_status(tmp_path) -> None:
    log = tmp_path / "run.log"
    assert run_process_group([sys.executable, "-c", "print('done'); raise SystemExit(3)"],
                             dict(os.environ), log, timeout=30) == (3, None)
    assert log.read_text().strip() == "done"
