"""Which folders count as checkpoints: a save killed just before its rename is not one."""

from __future__ import annotations

from pathlib import Path

from speculators_vllm016.train.checkpointer import TrainingState, find_checkpoints


def _complete_folder(folder: Path, state: TrainingState) -> None:
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (folder / name).write_bytes(b"")
    (folder / "training_state.json").write_text(state.to_json())


def test_a_complete_looking_temporary_folder_is_not_a_checkpoint(tmp_path):
    # Found by tests/cli/test_gen_and_train.py: SIGKILL after the state file of `.tmp-0-step2`
    # was written made the rerun resume from a folder the trainer then deleted.
    _complete_folder(tmp_path / "0-step1", TrainingState(epoch=0, step_in_epoch=1, global_step=1))
    _complete_folder(tmp_path / ".tmp-0-step2", TrainingState(epoch=0, step_in_epoch=2, global_step=2))
    assert [ref.name for ref in find_checkpoints(tmp_path)] == ["0-step1"]
