"""A resumed run and the settings it was started with: a changed learning rate (or other
optimizer / schedule setting) is applied from the resume on, with a warning naming old -> new,
and recorded; a run that is already complete says so instead of pretending to train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from speculators_vllm016.cli.train import main
from tests.training_fixtures import FIXED_SCHEDULE, train_args


def _lrs(save: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["lr"] for line in lines if "train" in line}


def _state(folder: Path) -> dict:
    return json.loads((folder / "training_state.json").read_text())


def _continue(
    tiny_llama, training_data, finished_run, tmp_path, capfd, *extra: str
) -> tuple[Path, str]:
    """The finished one-epoch run continued to a second epoch with `extra` flags."""
    save = tmp_path / "ckpt"
    shutil.copytree(finished_run, save, symlinks=True)
    capfd.readouterr()
    assert (
        main(train_args(tiny_llama, training_data, save, "--epochs", "2", *FIXED_SCHEDULE, *extra))
        == 0
    )
    return save, capfd.readouterr().err


def test_a_changed_lr_is_applied_from_the_resume_with_a_warning(
    tiny_llama, training_data, finished_run, tmp_path, capfd
):
    first = _state(finished_run / "0")["global_step"]
    save, err = _continue(tiny_llama, training_data, finished_run, tmp_path, capfd, "--lr", "2e-3")
    warnings = [line for line in err.splitlines() if "--lr" in line and "WARNING" in line]
    assert len(warnings) == 1 and "0.001 -> 0.002" in warnings[0], err[-3000:]
    lrs = _lrs(save)
    last = _state(save / "1")["global_step"]
    assert sorted(lrs) == list(range(last))
    for step in range(first):  # the first run's steps at its own rate (linear decay over 100)
        assert lrs[step] == pytest.approx(1e-3 * (1 - step / 100))
    for step in range(first, last):  # the resumed steps at the new one
        assert lrs[step] == pytest.approx(2e-3 * (1 - step / 100))
    assert yaml.safe_load((save / "train_config.yaml").read_text())["training"]["lr"] == 2e-3
    assert _state(save / "1")["optimizer"]["lr"] == 2e-3


def test_an_unchanged_lr_continues_the_schedule_without_a_warning(
    tiny_llama, training_data, finished_run, tmp_path, capfd
):
    save, err = _continue(tiny_llama, training_data, finished_run, tmp_path, capfd)
    assert " -> " not in err, err[-3000:]
    lrs = _lrs(save)
    assert all(lrs[step] == pytest.approx(1e-3 * (1 - step / 100)) for step in lrs)
    assert _state(save / "1")["optimizer"]["lr"] == 1e-3


def test_rerunning_a_finished_run_says_it_is_complete_and_trains_nothing(
    tiny_llama, training_data, finished_run, tmp_path, capfd
):
    save = tmp_path / "ckpt"
    shutil.copytree(finished_run, save, symlinks=True)
    before = (save / "metrics.jsonl").read_text()
    capfd.readouterr()
    assert main(train_args(tiny_llama, training_data, save, "--epochs", "1", *FIXED_SCHEDULE)) == 0
    out, err = capfd.readouterr()
    steps = _state(save / "0")["global_step"]
    assert (
        "already complete" in out.lower() and "raise --epochs" in out and f"{steps} steps" in out
    ), out
    assert "Done:" not in out and "resuming" not in err, err[-3000:]
    assert (save / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in save.iterdir() if p.name[0].isdigit()) == ["0"]


def test_epochs_are_numbered_as_the_checkpoint_folders_everywhere(
    tiny_llama, training_data, finished_run, tmp_path, capfd
):
    """Checkpoint folders count epochs from 0 (0.3.0's names); the log lines and the metrics
    say the same numbers."""
    save, err = _continue(tiny_llama, training_data, finished_run, tmp_path, capfd)
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert {line["epoch"] for line in lines} == {0, 1}
    assert _state(save / "1")["epoch"] == 1
    assert (
        "at epoch 1, step 0" in err and "epoch 1 (epochs 0 to 1)" in err and "epoch 2" not in err
    ), err[-3000:]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (("--num-layers", "2"), "--num-layers 2 (checkpoint: 1)"),
        (("--no-norm-before-residual",), "--no-norm-before-residual (checkpoint: True)"),
        (("--sliding-window", "4"), "--sliding-window 4 (checkpoint: full attention)"),
    ],
)
@pytest.mark.parametrize("epochs", ["1", "2"])
def test_a_resume_that_changes_the_draft_is_refused_before_anything_is_written(
    tiny_llama, training_data, finished_run, tmp_path, capfd, extra, named, epochs
):
    """The checkpoint's weights are its draft: a resumed run with another architecture would
    train a draft with freshly initialised parts (or, complete, record settings it never used)."""
    save = tmp_path / "ckpt"
    shutil.copytree(finished_run, save, symlinks=True)
    before = {p.name: p.read_bytes() for p in save.iterdir() if p.is_file()}
    capfd.readouterr()
    args = train_args(tiny_llama, training_data, save, "--epochs", epochs, *FIXED_SCHEDULE, *extra)
    assert main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "--save-path" in err[0], err
    assert {p.name: p.read_bytes() for p in save.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in save.iterdir() if p.name[0].isdigit()) == ["0"]


def test_a_new_run_on_request_may_change_the_draft(
    tiny_llama, training_data, finished_run, tmp_path, capfd
):
    save = tmp_path / "ckpt"
    shutil.copytree(finished_run, save, symlinks=True)
    args = train_args(
        tiny_llama, training_data, save, "--epochs", "1", *FIXED_SCHEDULE, "--num-layers", "2"
    )
    assert main([*args, "--no-resume-from-checkpoint"]) == 0
    config = json.loads((save / "0" / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert yaml.safe_load((save / "train_config.yaml").read_text())["model"]["num_layers"] == 2


def test_a_windowed_checkpoint_resumed_without_its_window_is_refused(
    tiny_llama, training_data, finished_run, tmp_path, capfd
):
    """The draft is rebuilt from the flags: without --sliding-window it would lose the
    checkpoint's window (a fine-tune of a windowed draft, or the flag forgotten) silently."""
    save = tmp_path / "ckpt"
    shutil.copytree(finished_run, save, symlinks=True)
    recorded = json.loads((save / "0" / "config.json").read_text())
    layer = recorded["transformer_layer_config"]
    layer["layer_types"], layer["sliding_window"] = ["sliding_attention"], 6
    (save / "0" / "config.json").write_text(json.dumps(recorded))
    capfd.readouterr()
    args = train_args(tiny_llama, training_data, save, "--epochs", "2", *FIXED_SCHEDULE)
    assert main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no --sliding-window (checkpoint: 6)" in err[0], err
    assert sorted(p.name for p in save.iterdir() if p.name[0].isdigit()) == ["0"]
