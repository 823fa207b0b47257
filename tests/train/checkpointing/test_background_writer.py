"""Checkpoints written in the background (`checkpointing.background_writer`): the step loop
gets back control after a snapshot, the files hold that snapshot and nothing later, a kill at
any point of the write leaves the previous checkpoint whole, a failed write stops the run, and
`keep_last` bounds the disk. Written inline (--no-background-checkpoints) they keep the same
crash guarantees, with no thread and no snapshot copy."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from speculators_vllm016.train import checkpointer as checkpointer_module
from speculators_vllm016.train.checkpointer import (
    MASTER_WEIGHTS,
    SingleGPUCheckpointer,
    TrainingState,
    find_checkpoints,
)
from speculators_vllm016.train.errors import CheckpointWriteError
from tests.train.scripted_draft import ScriptedDraft, packed_row, scripted_trainer
from tests.training_fixtures import cli_env


def _stepped(value: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A scripted draft whose weight is all `value`, after one AdamW step (so the optimizer
    has moments to save)."""
    model = ScriptedDraft(lambda training, call: {})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    optimizer.step()
    torch.nn.init.constant_(model.fc.weight, value)
    return model, optimizer


def _state(step: int) -> TrainingState:
    return TrainingState(epoch=0, step_in_epoch=step, global_step=step)


def test_the_loop_goes_on_during_the_write_and_the_files_hold_the_snapshot(tmp_path, monkeypatch):
    """`save` returns while the writer is held; the weights, optimizer moments and training
    state changed after it returns must not reach the files."""
    release = threading.Event()
    real_write = SingleGPUCheckpointer._write_files

    def held_write(self, temporary, job, weights, optimizer_state):
        assert release.wait(30)
        real_write(self, temporary, job, weights, optimizer_state)

    monkeypatch.setattr(SingleGPUCheckpointer, "_write_files", held_write)
    model, optimizer = _stepped(2.0)
    moments = {k: v.clone() for k, v in optimizer.state[model.fc.weight].items()}
    state = _state(2)
    saver = SingleGPUCheckpointer(tmp_path, background=True)
    path = saver.save("0-step2", model, optimizer, None, state)

    assert saver.writer.busy and not path.exists()  # returned before a file was written
    with torch.no_grad():  # training goes on: weights, moments and progress change in place
        model.fc.weight.fill_(99.0)
    for value in optimizer.state[model.fc.weight].values():
        value.add_(1000.0)
    state.global_step = 3
    release.set()
    saver.wait()

    assert [ref.name for ref in find_checkpoints(tmp_path)] == ["0-step2"]
    assert torch.all(load_file(path / MASTER_WEIGHTS)["fc.weight"] == 2.0)
    saved = torch.load(path / "optimizer_state_dict.pt", weights_only=True)["state"]["fc.weight"]
    for name, value in moments.items():
        assert torch.equal(saved[name], value), name
    assert TrainingState.from_json((path / "training_state.json").read_text()).global_step == 2


def test_a_failed_background_write_is_raised_once_and_leaves_the_previous_one(
    tmp_path, monkeypatch
):
    model, optimizer = _stepped(2.0)
    saver = SingleGPUCheckpointer(tmp_path, background=True)
    saver.save("0-step2", model, optimizer, None, _state(2))
    saver.wait()

    def full_disk(obj, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer_module, "torch_save", full_disk)
    with pytest.raises(CheckpointWriteError, match="the disk is full writing checkpoint 0-step4"):
        # The RNG file goes first, in the loop: a full disk there is raised by `save` itself.
        saver.save("0-step4", model, optimizer, None, _state(4))
    monkeypatch.undo()

    real_write = SingleGPUCheckpointer._write_files

    def full_disk_in_thread(self, temporary, job, weights, optimizer_state):
        real_write(self, temporary, job, weights, optimizer_state)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SingleGPUCheckpointer, "_write_files", full_disk_in_thread)
    saver.save("0-step6", model, optimizer, None, _state(6))
    with pytest.raises(CheckpointWriteError, match="0-step6 .*resume from .*0-step2"):
        saver.wait()
    saver.writer.raise_failure()  # raised once: nothing left to raise
    assert [ref.name for ref in find_checkpoints(tmp_path)] == ["0-step2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-step2"]  # the temporary one went


def test_inline_the_files_are_in_place_when_save_returns_and_nothing_is_copied(
    tmp_path, monkeypatch
):
    """--no-background-checkpoints: no thread, no snapshot of host tensors (the loop waits for
    the write, so nothing changes them meanwhile: a RAM-tight machine holds no second copy)."""
    from speculators_vllm016.train.checkpointing import background_writer

    model, optimizer = _stepped(2.0)
    staged: list = []
    real_stage = background_writer.stage

    def watched(tree, **kwargs):
        staged.append((tree, real_stage(tree, **kwargs)))
        return staged[-1][1]

    monkeypatch.setattr(checkpointer_module, "stage", watched)
    saver = SingleGPUCheckpointer(tmp_path, background=False)
    path = saver.save("0-step2", model, optimizer, None, _state(2))
    assert path.is_dir() and not saver.writer.busy and saver.writer._thread is None
    assert torch.all(load_file(path / MASTER_WEIGHTS)["fc.weight"] == 2.0)
    weights, copy = staged[0]
    # The live tensor's storage, written as it is.
    assert copy.tree["fc.weight"].data_ptr() == weights["fc.weight"].data_ptr()
    background = SingleGPUCheckpointer(tmp_path / "bg", background=True)
    background.save("0-step2", model, optimizer, None, _state(2))
    background.wait()
    weights, copy = staged[-2]
    # In the background: a snapshot.
    assert copy.tree["fc.weight"].data_ptr() != weights["fc.weight"].data_ptr()


def test_inline_a_failed_write_is_raised_by_save_and_leaves_the_previous_one(tmp_path, monkeypatch):
    model, optimizer = _stepped(2.0)
    saver = SingleGPUCheckpointer(tmp_path, background=False)
    saver.save("0-step2", model, optimizer, None, _state(2))

    def full_disk(self, temporary, job, weights, optimizer_state):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SingleGPUCheckpointer, "_write_files", full_disk)
    with pytest.raises(CheckpointWriteError, match="0-step4 .*resume from .*0-step2"):
        saver.save("0-step4", model, optimizer, None, _state(4))
    assert [ref.name for ref in find_checkpoints(tmp_path)] == ["0-step2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-step2"]  # the temporary one went


def test_the_trainer_writes_inline_when_the_job_says_so(tmp_path):
    """`background_checkpoints=False` (--no-background-checkpoints) reaches the checkpointer;
    the run's checkpoints are all there."""
    trainer = scripted_trainer(
        tmp_path / "ckpt",
        [packed_row()] * 4,
        checkpoint_freq=0.5,
        keep_mid_epoch_checkpoints=None,
        background_checkpoints=False,
    )
    assert not trainer.checkpointer.writer.background
    trainer.run_training()
    assert [ref.name for ref in find_checkpoints(tmp_path / "ckpt")] == ["0-step2", "0"]


def test_the_trainer_stops_after_the_step_in_which_a_background_write_failed(tmp_path, monkeypatch):
    """Not at the next checkpoint or the run's end: the step after the write failed."""
    import time

    def failing(self, temporary, job, weights, optimizer_state):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SingleGPUCheckpointer, "_write_files", failing)
    trainer: list = []

    def script(training: bool, call: int) -> dict:
        if training and call == 4:  # step 5, after the save at step 4: let the write fail first
            deadline = time.monotonic() + 30
            while trainer[0].checkpointer.writer.busy and time.monotonic() < deadline:
                time.sleep(0.01)
        return {}

    trainer.append(
        scripted_trainer(tmp_path / "ckpt", [packed_row()] * 8, script=script, checkpoint_freq=0.5)
    )
    with pytest.raises(CheckpointWriteError, match="the disk is full writing checkpoint 0-step4"):
        trainer[0].run_training()
    assert trainer[0].state.global_step == 5


# Kill (SIGKILL) the process from inside the writer thread, while the loop goes on changing the
# weights: at the optimizer state, right before the rename, or never (`master` kills at the
# master weights, the same case one file earlier).
_KILL_DURING_WRITE = """
import os, signal, sys, time
from pathlib import Path
import torch
from speculators_vllm016.train import checkpointer
from speculators_vllm016.train.checkpointer import SingleGPUCheckpointer
from tests.train.checkpointing.test_background_writer import _stepped, _state

save, kill_at, background = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "background"
model, optimizer = _stepped(2.0)
saver = SingleGPUCheckpointer(save, background=background)
saver.save("0-step2", model, optimizer, None, _state(2))
saver.wait()

def killing(real, point):
    def run(*args, **kwargs):
        if point == kill_at:
            target = Path(str(args[1]))
            target.write_bytes(b"half")  # a file cut short
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return run

checkpointer.save_file = killing(checkpointer.save_file, "master")
checkpointer.torch_save = killing(checkpointer.torch_save, "optimizer")
real_replace = checkpointer.replace_folder
def replace(source, target, **kwargs):
    if kill_at == "rename":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(source, target, **kwargs)
checkpointer.replace_folder = replace
torch.nn.init.constant_(model.fc.weight, 4.0)
saver.save("0-step4", model, optimizer, None, _state(4))
with torch.no_grad():
    for _ in range(200):  # the step loop goes on while the thread writes
        model.fc.weight.add_(1.0)
        time.sleep(0.001)
saver.wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize(
    ("kill_at", "kept", "writer"),
    [
        ("optimizer", 2, "background"),
        ("rename", 2, "background"),
        ("never", 4, "background"),
        ("optimizer", 2, "inline"),
        ("rename", 2, "inline"),
    ],
)
def test_a_kill_during_a_write_leaves_a_whole_checkpoint(tmp_path, kill_at, kept, writer):
    """The same guarantee with --no-background-checkpoints (`writer` "inline": the files are
    written by `save` itself, in the step loop; a write that ends is
    `test_the_trainer_writes_inline_when_the_job_says_so`)."""
    save = tmp_path / "ckpt"
    died = subprocess.run(
        [sys.executable, "-c", _KILL_DURING_WRITE, str(save), kill_at, writer],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == -signal.SIGKILL, died.stderr
    trainer = scripted_trainer(save, [packed_row()] * 8, num_epochs=2)  # what a resume does
    try:
        assert trainer.resume_ref is not None
        assert trainer.resume_ref.state.global_step == kept  # the old one or the new, whole
        assert torch.all(trainer.model.fc.weight == kept)  # the snapshot, not the later steps
        names = sorted(p.name for p in save.iterdir() if not p.name.startswith(".train"))
        assert names == (["0-step2"] if kept == 2 else ["0-step2", "0-step4"])  # swept
    finally:
        trainer.save_lock.release()


def test_keep_last_keeps_the_newest_and_the_best_and_a_run_ends_with_its_files(tmp_path):
    """Epoch and mid-epoch checkpoints alike: after each save only the newest `keep_last` and
    the one `best` names stay; `run_training` returns with the last checkpoint in place."""
    # Validation tau_sim 3, then 1, 2, 1: epoch 0 stays the best throughout.
    scores = [3.0, 1.0, 2.0, 1.0]
    trainer = scripted_trainer(
        tmp_path / "ckpt",
        [packed_row()] * 4,
        val_rows=[packed_row()],
        script=lambda training, call: {} if training else {"full_acc_0": scores[call] - 1},
        num_epochs=4,
        checkpoint_freq=0.5,
        keep_last_checkpoints=2,
        keep_mid_epoch_checkpoints=None,
    )
    trainer.run_training()
    save = tmp_path / "ckpt"
    names = sorted(p.name for p in save.iterdir() if p.is_dir() and not p.is_symlink())
    assert names == ["0", "3", "3-step14"], names
    assert (save / "best").resolve().name == "0"
    assert all((save / name / "training_state.json").is_file() for name in names)


def test_keep_last_below_one_is_refused_before_anything_is_written():
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig, TrainSetupError
    from speculators_vllm016.train.jobs.setup import _check_numbers

    config = TrainJobConfig()
    config.checkpoint.keep_last = 0
    with pytest.raises(TrainSetupError, match=r"^--keep-last must be at least 1 \(leave it out"):
        _check_numbers(config)
    config.checkpoint.keep_last = 1
    _check_numbers(config)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float32, (3, 7)),  # 84 bytes: chunks of 16 and a short last one
        (torch.bfloat16, (5, 9)),
        (torch.int64, ()),  # a step count
        (torch.bool, (33,)),
        (torch.float32, (0, 4)),
        (torch.float32, (4, 4)),  # exactly 4 chunks
    ],
)
def test_a_snapshot_comes_to_the_host_through_the_buffers_bit_for_bit(dtype, shape) -> None:
    """`copy_through` (how a device snapshot reaches the host in the writer thread) splits the
    tensor's bytes over two small reused buffers: every byte must land where it was, for any
    size (a short last chunk, one element, none) and dtype; the non-contiguous source too."""
    from speculators_vllm016.train.checkpointing.background_writer import copy_through

    generator = torch.Generator().manual_seed(0)
    source = torch.randn(shape, generator=generator).to(dtype) if dtype != torch.bool else None
    if source is None:
        source = torch.rand(shape, generator=generator) > 0.5
    buffers = [torch.full((16,), 255, dtype=torch.uint8) for _ in range(2)]
    waited: list[bool] = []  # per chunk copied: whether its wait ran before it was read

    def after_copy():
        index = len(waited)
        waited.append(False)
        return lambda: waited.__setitem__(index, True)

    copied = copy_through(source, buffers, after_copy)
    assert copied.dtype == source.dtype and copied.shape == source.shape
    assert torch.equal(copied.reshape(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8))
    chunks = -(-source.numel() * source.element_size() // 16)
    assert waited == [True] * chunks  # one copy per chunk, each waited for
    if source.dim() == 2 and source.numel():
        transposed = source.t()
        assert torch.equal(copy_through(transposed, buffers, after_copy), transposed)


def test_a_freed_snapshot_in_the_pool_counts_as_room_for_the_next(monkeypatch) -> None:
    """The device-room decision (`_room_on_device`, pure logic over the allocator's figures,
    which are stubbed here): free memory alone fell back to the synchronous copy at 32,768
    tokens while the previous snapshot's freed blocks sat in the pool. Those count now; the
    rest of the pool's unused memory (the activations') does not."""
    from speculators_vllm016.train.checkpointing import background_writer as writer

    gib = 2**30
    device = torch.device("cuda", 0)
    pool = {
        "reserved": 60 * gib,
        "allocated": 25 * gib,
    }  # 35 GiB unused: activations', a snapshot's
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (8 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _device: pool["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _device: pool["allocated"])
    monkeypatch.setattr(writer, "_RELEASED_SNAPSHOT_BYTES", {})
    snapshot = 15 * gib
    assert not writer._room_on_device(device, snapshot)  # 8 GiB free, nothing freed by a snapshot
    writer._RELEASED_SNAPSHOT_BYTES[device] = snapshot
    assert writer._room_on_device(device, snapshot)  # 8 + 15 >= 15 + 2 headroom
    assert not writer._room_on_device(device, 25 * gib)  # the activations' part does not count
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (1 * gib, 80 * gib))
    assert writer._room_on_device(device, snapshot)  # all of it where the last one was
    assert not writer._room_on_device(device, snapshot + gib // 2)  # the rest: no headroom left
    pool["reserved"] = 30 * gib  # the freed blocks went back to the driver: 5 GiB unused
    assert not writer._room_on_device(device, snapshot)


def test_the_weights_snapshot_leaves_the_optimizer_state_its_part_of_the_freed_pool(
    monkeypatch,
) -> None:
    """A save stages the weights, then the optimizer state; the save before freed both into the
    pool. The weights' snapshot takes back its own part of that count (`_retake_released`, as
    `stage` does after its clones), so the optimizer state's still counts as room. Zeroing the
    count there sent the optimizer state (9.1 GB at the Kimi-K2.5 draft's shapes) to the
    synchronous host copy at every save after the first on an H100."""
    from speculators_vllm016.train.checkpointing import background_writer as writer

    gib = 2**30
    device = torch.device("cuda", 0)
    weights, optimizer = 5 * gib, 9 * gib
    pool = {"reserved": 70 * gib, "allocated": 30 * gib}  # the freed snapshots' 14 GiB among it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (1 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _device: pool["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _device: pool["allocated"])
    monkeypatch.setattr(writer, "_RELEASED_SNAPSHOT_BYTES", {device: weights + optimizer})
    assert writer._room_on_device(device, weights)
    pool["allocated"] += weights  # the weights' clones, placed in the pool
    writer._retake_released(device, weights)
    assert writer._RELEASED_SNAPSHOT_BYTES[device] == optimizer
    assert writer._room_on_device(device, optimizer)
    pool["allocated"] += optimizer
    writer._retake_released(device, optimizer)
    assert writer._RELEASED_SNAPSHOT_BYTES[device] == 0
    writer._retake_released(device, gib)  # never below zero
    assert writer._RELEASED_SNAPSHOT_BYTES[device] == 0
