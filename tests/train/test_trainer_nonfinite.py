"""A step whose loss overflows leaves the weights as they were, and the log says so; a run
that trains no token at all fails."""

from __future__ import annotations

import shutil

import pytest
import torch

from speculators_vllm016.cli.train import main
from tests.training_fixtures import load_checkpoint_tensors, train_args


def test_a_diverging_run_skips_non_finite_updates_instead_of_saving_nan_weights(
    tiny_llama, training_data, tmp_path, capfd
):
    # A learning rate this large makes the weights huge after one step, so the next losses
    # overflow: their updates must be skipped, not turn every weight and moment into NaN.
    save = tmp_path / "ckpt"
    assert main(train_args(tiny_llama, training_data, save, "--epochs", "1", "--lr", "1e30")) == 0
    logged = capfd.readouterr()
    assert "this update was skipped" in logged.err + logged.out
    tensors = load_checkpoint_tensors(save / "0")
    assert all(torch.isfinite(tensor.float()).all() for tensor in tensors.values())


@pytest.mark.parametrize("case", ["every sample non-finite", "--total-seq-len 1 on chat samples"])
def test_a_run_that_trains_no_token_exits_non_zero_with_one_line(
    tiny_llama, training_data, tmp_path, capsys, case
):
    data = tmp_path / "data"
    shutil.copytree(training_data, data)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(training_data.parent / name, tmp_path / name)
    extra: tuple[str, ...] = ("--epochs", "1")
    if case == "every sample non-finite":
        for path in data.glob("data_*.pt"):
            sample = torch.load(path, weights_only=True)
            sample["hidden_states"] = [layer * float("nan") for layer in sample["hidden_states"]]
            torch.save(sample, path)
    else:
        # A chat sample starts with its prompt, which has no loss: one token a row trains none.
        for path in data.glob("data_*.pt"):
            sample = torch.load(path, weights_only=True)
            sample["loss_mask"][:4] = 0
            torch.save(sample, path)
        extra += ("--total-seq-len", "1")
    save = tmp_path / "ckpt"
    capsys.readouterr()
    assert main(train_args(tiny_llama, data, save, *extra)) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trained no token" in errors[0], errors
    assert not list(save.glob("[0-9]*")), "an untrained checkpoint was saved"
