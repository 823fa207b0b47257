"""Checkpoints: which folders count, and what loading refuses or accepts.

Resuming to the bit through the trainer is tested in tests/train/test_trainer.py; here the
checkpointer alone, on the tiny Eagle3 draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_vllm016.train.checkpointer import (
    MASTER_WEIGHTS,
    SingleGPUCheckpointer,
    TrainingState,
    find_checkpoints,
)
from tests.models.test_eagle3 import batch, draft_model


def _complete_folder(folder: Path, state: TrainingState) -> None:
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (folder / name).write_bytes(b"")
    (folder / "training_state.json").write_text(state.to_json())


def test_a_complete_looking_temporary_folder_is_not_a_checkpoint(tmp_path):
    # Found by tests/cli/test_gen_and_train.py: SIGKILL after the state file of `.tmp-0-step2`
    # was written made the rerun resume from a folder the trainer then deleted.
    _complete_folder(tmp_path / "0-step1", TrainingState(epoch=0, step_in_epoch=1, global_step=1))
    _complete_folder(
        tmp_path / ".tmp-0-step2", TrainingState(epoch=0, step_in_epoch=2, global_step=2)
    )
    assert [ref.name for ref in find_checkpoints(tmp_path)] == ["0-step1"]


def test_the_sweep_removes_temporary_folders_and_files_old_and_new(tmp_path):
    from speculators_vllm016.train.checkpointer import remove_temporary_folders

    _complete_folder(
        tmp_path / ".tmp-0-step2", TrainingState(epoch=0, step_in_epoch=2, global_step=2)
    )
    _complete_folder(tmp_path / "0-step1", TrainingState(epoch=0, step_in_epoch=1, global_step=1))
    for name in (".metrics.jsonl.0123abcd.tmp", ".metrics.jsonl.tmp", "metrics.jsonl"):
        (tmp_path / name).write_text("")
    remove_temporary_folders(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-step1", "metrics.jsonl"]


def _trained(verifier: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = draft_model(verifier)
    optimizer = torch.optim.AdamW(list(model.named_parameters()), lr=1e-3)
    model(**batch(), ttt_steps=2).loss.backward()
    optimizer.step()
    return model, optimizer


def test_a_saved_checkpoint_loads_back_exactly(tiny_llama, tmp_path):
    model, optimizer = _trained(str(tiny_llama))
    SingleGPUCheckpointer(tmp_path).save_checkpoint(model, optimizer, 0)
    fresh = draft_model(str(tiny_llama))
    fresh_optimizer = torch.optim.AdamW(list(fresh.named_parameters()), lr=1e-3)
    checkpointer = SingleGPUCheckpointer(tmp_path)
    checkpointer.load_model_state_dict(fresh)
    checkpointer.load_optimizer_state_dict(fresh, fresh_optimizer)
    for (name, saved), loaded in zip(
        model.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(saved, loaded), name
    for saved, loaded in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved[key], loaded[key]), key


def test_0_3_0_index_keyed_optimizer_state_loads(tiny_llama, tmp_path):
    """0.3.0's single-GPU save wrote `optimizer.state_dict()` as it is: keyed by index."""
    model, optimizer = _trained(str(tiny_llama))
    checkpointer = SingleGPUCheckpointer(tmp_path)
    checkpointer.save_checkpoint(model, optimizer, 0)
    torch.save(optimizer.state_dict(), checkpointer.optimizer_path(0))
    fresh_optimizer = torch.optim.AdamW(list(model.named_parameters()), lr=1e-3)
    checkpointer.load_optimizer_state_dict(model, fresh_optimizer)
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"],
        optimizer.state_dict()["state"][0]["exp_avg"],
    )


def test_optimizer_state_for_a_parameter_the_model_lacks_is_refused(tiny_llama, tmp_path):
    model, optimizer = _trained(str(tiny_llama))
    checkpointer = SingleGPUCheckpointer(tmp_path)
    checkpointer.save_checkpoint(model, optimizer, 0)
    state = torch.load(checkpointer.optimizer_path(0), weights_only=True)
    name = next(iter(state["state"]))
    state["state"]["not.a.parameter"] = state["state"].pop(name)
    torch.save(state, checkpointer.optimizer_path(0))
    fresh_optimizer = torch.optim.AdamW(list(model.named_parameters()), lr=1e-3)
    with pytest.raises(ValueError, match="parameters the model does not have: .*not.a.parameter"):
        checkpointer.load_optimizer_state_dict(model, fresh_optimizer)


def test_weights_the_model_lacks_are_refused(tiny_llama, tmp_path):
    """A checkpoint of another draft shape must not load silently into this one."""
    model, optimizer = _trained(str(tiny_llama))
    checkpointer = SingleGPUCheckpointer(tmp_path)
    checkpointer.save_checkpoint(model, optimizer, 0)
    master = tmp_path / "0" / MASTER_WEIGHTS
    weights = load_file(master)
    weights["layers.1.mlp.down_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, str(master))
    with pytest.raises(ValueError, match="weights the model lacks: .*layers.1.mlp.down_proj"):
        checkpointer.load_model_state_dict(draft_model(str(tiny_llama)))


# A checkpoint replaced under the same name, killed (SIGKILL) before filesystem step k of
# `replace_folder`: 1 sweep a stale aside, 2 move the old folder aside, 3 rename the new one in,
# 4 delete the old one (killed half way through it), 5 after the whole replacement.
_REPLACE_AND_DIE = """
import os, shutil, signal, sys
from pathlib import Path
import torch
from speculators_vllm016.train import checkpointer
from speculators_vllm016.utils import atomic_files
from tests.train.test_checkpointer import save_scripted

save, kill_at = Path(sys.argv[1]), int(sys.argv[2])
done = []
real_replace, real_rmtree, real_replace_folder = os.replace, shutil.rmtree, atomic_files.replace_folder

def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)

def step(real):
    def run(path, *args, **kwargs):
        done.append(path)
        if len(done) == kill_at:
            if real is real_rmtree and Path(path).is_dir():
                (Path(path) / "model.safetensors").unlink()  # half deleted
            die()
        return real(path, *args, **kwargs)
    return run

def replace_folder(*args, **kwargs):
    os.replace, shutil.rmtree = step(real_replace), step(real_rmtree)
    try:
        real_replace_folder(*args, **kwargs)
    finally:
        os.replace, shutil.rmtree = real_replace, real_rmtree
    if kill_at == 5:
        die()

checkpointer.replace_folder = replace_folder
save_scripted(save, global_step=4)
"""


def save_scripted(save: Path, global_step: int) -> None:
    """Checkpoint `0` of a scripted draft whose weights all equal `global_step` (tells which
    save a folder holds, and that its files belong together)."""
    from tests.train.scripted_draft import ScriptedDraft

    model = ScriptedDraft(lambda training, call: {})
    torch.nn.init.constant_(model.fc.weight, float(global_step))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainingState(epoch=0, step_in_epoch=global_step, global_step=global_step)
    SingleGPUCheckpointer(save).save("0", model, optimizer, None, state)


@pytest.mark.parametrize(("kill_at", "kept"), [(1, 2), (2, 2), (3, 2), (4, 4), (5, 4)])
def test_a_checkpoint_replaced_under_a_kill_at_any_step_resumes_whole(tmp_path, kill_at, kept):
    import signal
    import subprocess
    import sys

    from tests.train.scripted_draft import packed_row, scripted_trainer
    from tests.training_fixtures import cli_env

    save = tmp_path / "ckpt"
    save_scripted(save, global_step=2)
    died = subprocess.run(
        [sys.executable, "-c", _REPLACE_AND_DIE, str(save), str(kill_at)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == -signal.SIGKILL, died.stderr
    trainer = scripted_trainer(save, [packed_row()] * 8, num_epochs=2)  # what a resume does
    try:
        assert trainer.resume_ref is not None and trainer.resume_ref.path == save / "0"
        assert trainer.resume_ref.state.global_step == kept  # the old one or the new, whole
        assert torch.all(trainer.model.fc.weight == kept)
        assert sorted(p.name for p in save.iterdir() if not p.name.startswith(".train")) == ["0"]
    finally:
        trainer.save_lock.release()


def test_every_checkpoint_file_is_readable_by_other_users_as_the_umask_allows(tiny_llama, tmp_path):
    """safetensors 0.8 writes through a 0600 temporary file: a server running as another user
    could not read the draft. Each file gets the mode a plain `open` gives under the umask."""
    import os

    model, optimizer = _trained(str(tiny_llama))
    previous = os.umask(0o022)
    try:
        SingleGPUCheckpointer(tmp_path).save_checkpoint(model, optimizer, 0)
    finally:
        os.umask(previous)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "0").iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {"0o644"}, modes
