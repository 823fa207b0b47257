"""One training process per save path (issue #29 item 2): a second one is refused in one line
naming the first's pid, and the lock goes with its holder, however that process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from speculators_vllm016.train.checkpointing.save_lock import LOCK_FILE
from speculators_vllm016.train.errors import SavePathInUse, TrainingError
from tests.train.scripted_draft import packed_row, scripted_trainer
from tests.training_fixtures import cli_env


def test_a_second_trainer_on_the_same_save_path_is_refused_until_the_first_ends(tmp_path):
    save = tmp_path / "ckpt"
    first = scripted_trainer(save, [packed_row()])
    with pytest.raises(SavePathInUse) as refused:
        scripted_trainer(save, [packed_row()])
    message = str(refused.value)
    assert isinstance(refused.value, TrainingError) and "\n" not in message
    assert f"pid {os.getpid()}" in message and str(save) in message
    assert scripted_trainer(tmp_path / "other", [packed_row()]) is not None  # other paths are free
    first.run_training()
    assert scripted_trainer(save, [packed_row()], num_epochs=2).run_training().epoch == 1


HOLD = """
import sys, time
from speculators_vllm016.train.checkpointing.save_lock import SavePathLock
lock = SavePathLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_process_is_gone_with_it(tmp_path):
    save = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(save)], env=cli_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            SavePathInUse, match=f"another training process \\(pid {holder.pid} on "
        ):
            scripted_trainer(save, [packed_row()])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert (save / LOCK_FILE).exists()  # left behind, and no obstacle: the kernel let go
    scripted_trainer(save, [packed_row()]).run_training()
    assert (save / "0").is_dir()
