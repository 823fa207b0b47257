"""SIGTERM to the whole process group (SLURM preemption, scancel, systemd, `timeout`): the
trainer and its loader processes all receive it; the trainer finishes the step, checkpoints and
exits 143 as for a signal to the main process alone, and the same command resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.training_fixtures import cli_env, finished_checkpoints, train_args, train_command


def _logged_steps(save: Path) -> int:
    path = save / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"train"' in line)


def _stop_group(command: list[str], save: Path, ready) -> tuple[int, str]:
    """Start `command` in a process group of its own; once `ready(output so far)` holds, SIGTERM
    the whole group (as a scheduler does); its return code and output."""
    log = save.parent / "output.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            command,
            env=cli_env(),
            start_new_session=True,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            while process.poll() is None and not ready(log.read_text()):
                time.sleep(0.01)
            assert process.poll() is None, (
                "the run ended before the signal:\n" + log.read_text()[-3000:]
            )
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=300)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after the first step", "during the first step"])
def test_sigterm_to_the_process_group_checkpoints_and_resumes(
    tiny_llama, training_data, tmp_path, when
):
    save = tmp_path / "ckpt"
    # Loader processes (--num-workers 2) are in the group too: they must not die of the signal.
    command = train_command(train_args(tiny_llama, training_data, save, "--num-workers", "2"))
    if when == "after the first step":
        ready = lambda output: _logged_steps(save) >= 1  # noqa: E731
    else:  # the trainer announced the epoch; its first step (compile included) has not ended
        ready = lambda output: "INFO speculators: epoch 0 (" in output  # noqa: E731
    code, output = _stop_group(command, save, ready)
    assert code == 143, output[-3000:]
    assert "stopped by SIGTERM at step" in output, output[-3000:]
    assert "killed by signal" not in output and "Traceback" not in output, output[-3000:]
    written = finished_checkpoints(save)
    assert len(written) == 1 and "-step" in written[0], written
    state = json.loads((save / written[0] / "training_state.json").read_text())
    assert state["global_step"] >= 1
    if when == "during the first step":
        assert state["global_step"] == 1 and _logged_steps(save) == 1

    again = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    assert (save / "1" / "training_state.json").is_file()
