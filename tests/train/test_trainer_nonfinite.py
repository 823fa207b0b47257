"""A step whose loss overflows leaves the weights as they were, and the log says so."""

from __future__ import annotations

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
