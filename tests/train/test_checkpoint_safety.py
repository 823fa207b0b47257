"""What resuming reads from a checkpoint cannot run code, and its failures say what to do: a
planted pickle is refused, a cut file is named with the checkpoint to resume from instead, and
a full disk while saving says so (issue #29 items 3 and 9)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from speculators_vllm016.train.checkpointing.checkpoint_files import is_disk_full
from speculators_vllm016.train.checkpointing.rng_state import capture_rng_state, restore_rng_state
from speculators_vllm016.train.errors import CheckpointReadError, CheckpointWriteError
from tests.train.scripted_draft import packed_row, scripted_trainer


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_states_are_tensors_and_plain_values_and_restore_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)  # noqa: B018
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian in both  # noqa: B018
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = _draws()
    state = torch.load(tmp_path / "rng.pt", weights_only=True)  # no allow-list needed
    restore_rng_state(state)
    assert _draws() == expected


def test_an_rng_state_of_the_earlier_layout_still_resumes(tmp_path):
    """Checkpoints written before: python's state a tuple, numpy's with an array."""
    from speculators_vllm016.train.checkpointer import SingleGPUCheckpointer

    random.seed(4), np.random.seed(5), torch.manual_seed(6)  # noqa: B018
    folder = tmp_path / "0"
    folder.mkdir()
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
        folder / "rng_state_rank0.pt",
    )
    expected = _draws()
    restore_rng_state(SingleGPUCheckpointer(tmp_path).load_rng_state(folder))
    assert _draws() == expected


class _Planted:
    """A pickle that creates a file when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _two_epochs(save: Path, **config) -> None:
    scripted_trainer(save, [packed_row(), packed_row()], num_epochs=2, **config).run_training()


def test_a_planted_pickle_in_an_rng_state_is_refused_and_never_runs(tmp_path):
    save, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    _two_epochs(save)
    torch.save(
        {"python": _Planted(marker), "numpy": 0, "torch": 0}, save / "1" / "rng_state_rank0.pt"
    )
    trainer = scripted_trainer(save, [packed_row(), packed_row()], num_epochs=3)
    with pytest.raises(CheckpointReadError, match="would run code") as raised:
        trainer.run_training()
    assert not marker.exists(), "loading the checkpoint ran code from it"
    message = str(raised.value)
    assert "\n" not in message and f"rng_state_rank0.pt of checkpoint {save / '1'}" in message


@pytest.mark.parametrize(
    "name", ["optimizer_state_dict.pt", "scheduler_state_dict.pt", "rng_state_rank0.pt"]
)
def test_a_planted_pickle_in_any_state_file_runs_nothing_and_is_refused_in_one_line(tmp_path, name):
    # Each .pt file of a checkpoint is read on resume; none may be unpickled with code execution.
    save, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    _two_epochs(save, scheduler_type="linear")
    path = save / "1" / name
    assert path.is_file()
    torch.save({"state": _Planted(marker), "param_groups": []}, path)
    trainer = None
    with pytest.raises(CheckpointReadError) as raised:
        trainer = scripted_trainer(
            save, [packed_row(), packed_row()], num_epochs=3, scheduler_type="linear"
        )
        trainer.run_training()
    assert not marker.exists(), f"loading {name} ran code from it"
    message = str(raised.value)
    assert "\n" not in message and f"{name} of checkpoint {save / '1'}" in message, message
    assert "would run code" in message, message


@pytest.mark.parametrize(
    "name",
    [
        "rng_state_rank0.pt",
        "master_weights.safetensors",
        "model.safetensors",
        "optimizer_state_dict.pt",
        "scheduler_state_dict.pt",
    ],
)
def test_a_cut_checkpoint_file_is_named_with_the_checkpoint_to_resume_from(tmp_path, name):
    # Weights saved in fp32 have no master copy: resuming reads model.safetensors then.
    config = {"scheduler_type": "linear"}
    if name == "model.safetensors":
        config["checkpoint_dtype"] = torch.float32
    save = tmp_path / "ckpt"
    _two_epochs(save, **config)
    assert (save / "1" / "master_weights.safetensors").exists() == (name != "model.safetensors")
    path = save / "1" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointReadError) as raised:
        scripted_trainer(save, [packed_row(), packed_row()], num_epochs=3, **config).run_training()
    message = str(raised.value)
    assert "\n" not in message
    assert f"{name} of checkpoint {save / '1'} cannot be read" in message
    assert "run the same command again to resume from 0" in message


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_while_saving_says_so_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """The optimizer state's file is /dev/full, where every write fails as on a full disk
    (torch's own writer then reports "unexpected pos", not the disk)."""
    from speculators_vllm016.train.checkpointer import SingleGPUCheckpointer

    write_files = SingleGPUCheckpointer._write_files

    def onto_a_full_disk(self, temporary: Path, *args, **kwargs):
        (temporary / "optimizer_state_dict.pt").symlink_to("/dev/full")
        return write_files(self, temporary, *args, **kwargs)

    monkeypatch.setattr(SingleGPUCheckpointer, "_write_files", onto_a_full_disk)
    save = tmp_path / "ckpt"
    trainer = scripted_trainer(save, [packed_row(), packed_row()])
    with pytest.raises(
        CheckpointWriteError, match="the disk is full writing checkpoint 0"
    ) as raised:
        trainer.run_training()
    assert "\n" not in str(raised.value)
    left = [p.name for p in save.iterdir() if p.name[0].isdigit() or p.name.startswith(".tmp-")]
    assert not left, left


def test_safetensors_words_for_a_full_disk_count_as_one():
    assert is_disk_full(
        RuntimeError(
            "Error while serializing: IoError(Os { code: 28, kind: "
            'StorageFull, message: "No space left on device" })'
        )
    )
    assert not is_disk_full(RuntimeError("unexpected pos 64 vs 0"))


def test_a_cut_training_state_leaves_its_checkpoint_out_and_resume_takes_the_one_before(
    tmp_path, caplog
):
    save = tmp_path / "ckpt"
    _two_epochs(save)
    state = save / "1" / "training_state.json"
    state.write_text(state.read_text()[:20])
    trainer = scripted_trainer(save, [packed_row(), packed_row()], num_epochs=3)
    assert trainer.resume_ref is not None and trainer.resume_ref.path == save / "0"
    assert "training_state.json of checkpoint" in caplog.text and "left out" in caplog.text
    trainer.save_lock.release()
