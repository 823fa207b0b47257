"""One convention for a stopped command (#50 item 9): `stopped: ...` and 128 + the signal's
number, 130 after Ctrl-C and 143 after SIGTERM; train exited 143 after Ctrl-C too."""

from __future__ import annotations

import signal

import pytest

from speculators_vllm016.cli.train import main
from speculators_vllm016.train.trainer import Trainer
from tests.training_fixtures import train_args


@pytest.mark.parametrize(
    ("signum", "name"), [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")]
)
def test_a_stopped_training_exits_with_128_plus_the_signal(
    tiny_llama, training_data, tmp_path, monkeypatch, capfd, signum, name
):
    step = Trainer.train_step

    def step_then_signal(self, batch):  # the handler's effect, after the second step
        metrics = step(self, batch)
        if self.state.global_step >= 1:
            self.shutdown.on_signal(signum, None)
        return metrics

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # on_signal's handler swap
    capfd.readouterr()
    assert (
        main(train_args(tiny_llama, training_data, tmp_path / "ckpt", "--epochs", "1"))
        == 128 + signum
    )
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"stopped: stopped by {name} at step"), err[-3:]
    assert "run the same command again to resume" in err[-1]
