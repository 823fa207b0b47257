"""tau_sim from the trainer's metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.evaluate.training_metrics import find_training_estimate
from speculators_vllm016.train.metrics_log import simulated_tau


def write_lines(path, records, garbage=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record) + "\n" for record in records)
    path.write_text(text + ('{"epoch": 3, "val/full_acc_0' if garbage else ""))


def test_tau_sim_is_one_plus_the_sum_of_full_acc():
    assert simulated_tau([0.5, 0.25, 0.125]) == pytest.approx(1.875)


def test_epoch_folder_takes_its_own_validation_line(tmp_path):
    records = [
        {"epoch": 0, "val/full_acc_0_epoch": 0.4, "val/full_acc_1_epoch": 0.1},
        {"epoch": 1, "full_acc_0": 0.99, "full_acc_1": 0.99},  # a training step: not validation
        {"epoch": 1, "val/full_acc_0_epoch": 0.6, "val/full_acc_1_epoch": 0.3},
        {"epoch": 2, "val/loss_epoch": 1.0},
    ]
    write_lines(tmp_path / "metrics.jsonl", records, garbage=True)
    for epoch, expected in ((0, 1.5), (1, 1.9)):
        (tmp_path / str(epoch)).mkdir()
        estimate = find_training_estimate(tmp_path / str(epoch))
        assert estimate is not None and estimate.tau_sim == pytest.approx(expected)
        assert estimate.epoch == epoch and estimate.source == str(tmp_path / "metrics.jsonl")
    (tmp_path / "2").mkdir()
    assert find_training_estimate(tmp_path / "2") is None  # no accuracies for that epoch


def test_the_trainers_nested_validation_lines(tmp_path):
    """The shape `Trainer.val_epoch` logs through the JSONL handler; train lines do not count."""
    records = [
        {"step": 4, "train": {"loss": 2.0, "full_acc_0": 0.9, "full_acc_1": 0.9}},
        {
            "step": 5,
            "val": {
                "loss_epoch": 1.5,
                "full_acc_0_epoch": 0.5,
                "full_acc_1_epoch": 0.25,
                "cond_acc_1_epoch": 0.5,
                "tau_sim": 1.75,
            },
            "epoch": 0,
        },
        {"step": 9, "train": {"loss": 1.0, "full_acc_0": 0.95, "full_acc_1": 0.95}},
    ]
    write_lines(tmp_path / "metrics.jsonl", records)
    (tmp_path / "0").mkdir()
    estimate = find_training_estimate(tmp_path / "0")
    assert estimate is not None and estimate.tau_sim == pytest.approx(1.75)
    assert estimate.full_acc == [0.5, 0.25] and estimate.epoch == 0


def test_metrics_inside_the_draft_folder_and_plain_keys(tmp_path):
    write_lines(
        tmp_path / "draft" / "metrics.jsonl",
        [{"full_acc_0": 0.2, "full_acc_1": 0.1}, {"full_acc_0": 0.5, "full_acc_1": 0.2}],
    )
    estimate = find_training_estimate(tmp_path / "draft")
    assert estimate is not None and estimate.tau_sim == pytest.approx(1.7)
    assert estimate.full_acc == [0.5, 0.2]
    assert find_training_estimate(tmp_path / "elsewhere") is None
