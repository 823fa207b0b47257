"""Which checkpoints a run leaves behind and whose run they are: pruning, --no-resume over an
earlier run, resuming with another seed, and the warm-up of a run capped by --max-steps.

In-process runs of the tiny draft (a few steps each) through `speculators train`'s `main`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from speculators_vllm016.cli.train import main
from speculators_vllm016.train.metrics_log import MetricsLog
from speculators_vllm016.train.trainer import Trainer
from tests.training_fixtures import train_args


def checkpoint_names(save: Path) -> set[str]:
    return {
        p.name for p in save.iterdir() if p.is_dir() and not p.is_symlink() and p.name[0].isdigit()
    }


def train_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"train"' in line]


def lrs(save: Path) -> list[float]:
    return [
        json.loads(line)["lr"]
        for line in (save / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]


def interrupt_in_step(patcher: pytest.MonkeyPatch, number: int) -> None:
    """Make the trainer's `number`-th step raise KeyboardInterrupt (Ctrl-C) before its work."""
    step = Trainer.train_step
    calls = []

    def interrupted_step(self, batch):
        calls.append(1)
        if len(calls) == number:
            raise KeyboardInterrupt
        return step(self, batch)

    patcher.setattr(Trainer, "train_step", interrupted_step)


@pytest.fixture(scope="module")
def earlier_run(tiny_llama, training_data, tmp_path_factory) -> Path:
    """A finished two-epoch run: folders 0 and 1, `best`, metrics.jsonl."""
    save = tmp_path_factory.mktemp("earlier") / "ckpt"
    assert main(train_args(tiny_llama, training_data, save)) == 0
    assert checkpoint_names(save) == {"0", "1"} and (save / "best").is_symlink()
    return save


def test_keep_zero_keeps_the_checkpoint_just_written(tiny_llama, training_data, tmp_path, capsys):
    save = tmp_path / "ckpt"
    extra = ("--keep-mid-epoch-checkpoints", "0", "--checkpoint-freq", "0.5")
    assert main(train_args(tiny_llama, training_data, save, *extra, "--max-steps", "3")) == 0
    # The half-epoch checkpoint gave way to the --max-steps one, which stays.
    assert checkpoint_names(save) == {"0-step3"}
    capsys.readouterr()
    assert main(train_args(tiny_llama, training_data, save, *extra, "--max-steps", "4")) == 0
    assert "resuming from" in capsys.readouterr().err
    assert checkpoint_names(save) == {"0-step4"}
    assert train_steps(save / "metrics.jsonl") == [0, 1, 2, 3]


def test_no_resume_replaces_the_earlier_run_at_its_first_checkpoint(
    tiny_llama, training_data, tmp_path, earlier_run, capsys
):
    save = tmp_path / "ckpt"
    shutil.copytree(earlier_run, save, symlinks=True)
    earlier_metrics = (save / "metrics.jsonl").read_text()
    assert (
        main(
            train_args(
                tiny_llama, training_data, save, "--no-resume-from-checkpoint", "--max-steps", "3"
            )
        )
        == 0
    )
    assert "deleted when this run finishes its first epoch" in capsys.readouterr().err
    assert checkpoint_names(save) == {"0-step3"}, (
        "the earlier run's checkpoints survived or pruned ours"
    )
    assert not (save / "best").is_symlink(), "best still names the earlier run's checkpoint"
    assert train_steps(save / "metrics.jsonl") == [0, 1, 2]
    assert (save / "metrics.jsonl.prev").read_text() == earlier_metrics
    # A plain rerun continues this run, not the earlier one.
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "4")) == 0
    assert f"resuming from {save / '0-step3'}" in capsys.readouterr().err
    assert checkpoint_names(save) == {"0-step4"}
    assert train_steps(save / "metrics.jsonl") == [0, 1, 2, 3]


def test_each_no_resume_run_starts_its_own_metrics_log(tiny_llama, training_data, tmp_path):
    save = tmp_path / "ckpt"
    no_resume = "--no-resume-from-checkpoint"
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "3")) == 0
    assert main(train_args(tiny_llama, training_data, save, no_resume, "--max-steps", "2")) == 0
    assert main(train_args(tiny_llama, training_data, save, no_resume, "--max-steps", "1")) == 0
    assert train_steps(save / "metrics.jsonl") == [0]
    assert train_steps(save / "metrics.jsonl.prev") == [0, 1]


@pytest.mark.parametrize("stopped_in_step", [1, 2])
def test_no_resume_stopped_before_its_first_checkpoint_leaves_the_earlier_run(
    tiny_llama, training_data, tmp_path, earlier_run, monkeypatch, stopped_in_step
):
    save = tmp_path / "ckpt"
    shutil.copytree(earlier_run, save, symlinks=True)
    interrupt_in_step(monkeypatch, stopped_in_step)  # before any checkpoint
    assert main(train_args(tiny_llama, training_data, save, "--no-resume-from-checkpoint")) == 130
    assert checkpoint_names(save) == {"0", "1"}
    assert os.readlink(save / "best") == os.readlink(earlier_run / "best")
    assert (save / "metrics.jsonl").read_text() == (earlier_run / "metrics.jsonl").read_text()
    if stopped_in_step == 1:  # nothing logged: nothing of this run to keep
        assert not (save / "metrics.jsonl.prev").exists()
    else:
        assert train_steps(save / "metrics.jsonl.prev") == [0], "the stopped run's line is lost"
    assert not (save / ".run-without-checkpoint").exists()


def request_stop_in_step(patcher: pytest.MonkeyPatch, number: int, reason: str) -> None:
    """Make the trainer receive a stop request (SIGTERM, a first Ctrl-C) during its
    `number`-th step: it finishes the step, then stops as it does on the signal."""
    step = Trainer.train_step
    calls = []

    def step_then_signal(self, batch):
        calls.append(1)
        metrics = step(self, batch)
        if len(calls) == number:
            self.shutdown.requested, self.shutdown.reason = True, reason
        return metrics

    patcher.setattr(Trainer, "train_step", step_then_signal)


@pytest.mark.parametrize("reason", ["SIGTERM", "Ctrl-C"])
def test_a_stop_request_in_the_first_epoch_of_a_no_resume_run_leaves_the_earlier_run(
    tiny_llama, training_data, tmp_path, earlier_run, monkeypatch, capsys, reason
):
    """Issue #29 item 1: the checkpoint a stop request writes must not be what deletes the
    earlier run, nor may the --checkpoint-freq ones of the new run's first epoch."""
    save = tmp_path / "ckpt"
    shutil.copytree(earlier_run, save, symlinks=True)
    request_stop_in_step(monkeypatch, 3, reason)  # after the 0.25-epoch checkpoints' steps
    capsys.readouterr()
    code = main(
        train_args(
            tiny_llama,
            training_data,
            save,
            "--no-resume-from-checkpoint",
            "--checkpoint-freq",
            "0.25",
        )
    )
    assert code == 143
    assert checkpoint_names(save) == {"0", "1"}, "the earlier run's checkpoints were touched"
    error = capsys.readouterr().err
    assert f"stopped by {reason} at step 3" in error and "left as it was" in error
    assert os.readlink(save / "best") == os.readlink(earlier_run / "best")
    assert (save / "metrics.jsonl").read_text() == (earlier_run / "metrics.jsonl").read_text()
    assert train_steps(save / "metrics.jsonl.prev") == [0, 1, 2]
    assert not (save / ".run-without-checkpoint").exists()
    # Resuming continues the earlier run, which is whole.
    assert main(train_args(tiny_llama, training_data, save, "--epochs", "3")) == 0
    assert f"resuming from {save / '1'}" in capsys.readouterr().err


def test_a_no_resume_run_replaces_the_earlier_run_at_the_end_of_its_first_epoch(
    tiny_llama, training_data, tmp_path, earlier_run
):
    save = tmp_path / "ckpt"
    shutil.copytree(earlier_run, save, symlinks=True)
    assert (
        main(
            train_args(
                tiny_llama,
                training_data,
                save,
                "--no-resume-from-checkpoint",
                "--checkpoint-freq",
                "0.25",
                "--epochs",
                "1",
            )
        )
        == 0
    )
    names = checkpoint_names(save)
    assert "0" in names and "1" not in names, names
    assert os.readlink(save / "best") == "0"


def test_a_killed_no_resume_run_leaves_the_earlier_run_whole_at_the_next_start(
    tiny_llama, training_data, tmp_path, earlier_run, monkeypatch, capsys
):
    """SIGKILL before the first checkpoint runs no clean-up: emulated by a run that stops with
    its clean-up (`MetricsLog.restore_earlier`) switched off. The next start puts the earlier
    run's metrics back beside its checkpoints, and resuming continues that run's log."""
    save = tmp_path / "ckpt"
    shutil.copytree(earlier_run, save, symlinks=True)
    with monkeypatch.context() as patched:
        interrupt_in_step(patched, 3)
        patched.setattr(MetricsLog, "restore_earlier", lambda self: None)
        assert (
            main(train_args(tiny_llama, training_data, save, "--no-resume-from-checkpoint")) == 130
        )
    assert train_steps(save / "metrics.jsonl") == [0, 1], "the emulated kill cleaned up"
    capsys.readouterr()
    assert main(train_args(tiny_llama, training_data, save, "--epochs", "3")) == 0
    assert "ended before its first checkpoint" in capsys.readouterr().err
    assert train_steps(save / "metrics.jsonl.prev") == [0, 1]
    earlier = train_steps(earlier_run / "metrics.jsonl")
    assert train_steps(save / "metrics.jsonl")[: len(earlier)] == earlier
    assert not (save / ".run-without-checkpoint").exists()


def test_resume_with_another_seed_warns_and_records_the_new_seed(
    tiny_llama, training_data, tmp_path, capsys
):
    save = tmp_path / "ckpt"
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "2")) == 0
    capsys.readouterr()
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "3", "--seed", "7")) == 0
    err = capsys.readouterr().err
    assert "--seed 0, resuming with --seed 7" in err and "differ" in err
    state = json.loads((save / "0-step3" / "training_state.json").read_text())
    assert state["seed"] == 7
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "4", "--seed", "7")) == 0
    assert "resuming with --seed" not in capsys.readouterr().err


def test_resume_on_changed_training_data_warns(tiny_llama, training_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(training_data, data)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(training_data.parent / name, tmp_path / name)
    save = tmp_path / "ckpt"
    assert main(train_args(tiny_llama, data, save, "--max-steps", "2")) == 0
    capsys.readouterr()
    assert main(train_args(tiny_llama, data, save, "--max-steps", "3")) == 0
    assert "other training data" not in capsys.readouterr().err
    samples = sorted(data.glob("data_*.pt"))
    shutil.copy(samples[0], data / f"data_{len(samples) + 100}.pt")  # datagen added a sample
    assert main(train_args(tiny_llama, data, save, "--max-steps", "4")) == 0
    assert "checkpoint written for other training data" in capsys.readouterr().err
    assert main(train_args(tiny_llama, data, save, "--max-steps", "5")) == 0
    assert "other training data" not in capsys.readouterr().err, "the new data set was not recorded"


def test_resume_with_another_deterministic_setting_warns(
    tiny_llama, training_data, tmp_path, capsys
):
    save = tmp_path / "ckpt"
    assert (
        main(train_args(tiny_llama, training_data, save, "--max-steps", "1", "--deterministic"))
        == 0
    )
    capsys.readouterr()
    assert (
        main(train_args(tiny_llama, training_data, save, "--max-steps", "2", "--deterministic"))
        == 0
    )
    assert "--deterministic" not in capsys.readouterr().err
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "3")) == 0
    assert "checkpoint written with --deterministic, resuming without it" in capsys.readouterr().err
    assert main(train_args(tiny_llama, training_data, save, "--max-steps", "4")) == 0
    assert "--deterministic" not in capsys.readouterr().err, "the new setting was not recorded"


def test_default_warmup_is_one_percent_of_the_capped_run(tiny_llama, training_data, tmp_path):
    # 100 epochs would warm up for a whole epoch's steps; capped at 3 steps the warm-up is 0
    # steps and the learning rate decays from the first step on.
    save = tmp_path / "ckpt"
    assert (
        main(train_args(tiny_llama, training_data, save, "--epochs", "100", "--max-steps", "3"))
        == 0
    )
    rates = lrs(save)
    assert len(rates) == 3 and rates[0] == pytest.approx(1e-3)
    assert rates[0] > rates[1] > rates[2]
