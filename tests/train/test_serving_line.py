"""`speculators train` says at start-up whether vLLM can serve the draft it is about to train."""

from __future__ import annotations

from speculators_vllm016.cli.train import main
from tests.training_fixtures import train_args


def test_train_names_the_serving_verdict_before_training(
    tiny_llama, training_data, tmp_path, capfd
):
    assert main(train_args(tiny_llama, training_data, tmp_path / "ckpt", "--epochs", "1")) == 0
    err = capfd.readouterr().err
    assert "vLLM 0.16.0 can serve an EAGLE-3 draft for this target" in err
