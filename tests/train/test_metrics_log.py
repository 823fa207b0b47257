"""The metrics log: its one reader, the truncation on resume, tau_sim's one formula."""

from __future__ import annotations

import json
import logging

import pytest

from speculators_vllm016.evaluate import training_metrics
from speculators_vllm016.train import train_step
from speculators_vllm016.train.logger import METRICS_LOGGER, JsonlHandler
from speculators_vllm016.train.metrics_log import (
    MetricsLog,
    log_train_step,
    log_validation,
    read_metrics,
    read_train_steps,
    simulated_tau,
    tau_sim,
)


def test_one_tau_sim_formula():
    assert training_metrics.simulated_tau is simulated_tau
    assert train_step.tau_sim is tau_sim  # validation means score with it
    assert tau_sim({"loss": 2.0, "full_acc_0": 0.5, "full_acc_1": 0.25}) == pytest.approx(1.75)
    assert tau_sim({"loss": 2.0}) is None


def test_the_writer_and_the_reader_agree_on_the_schema(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = logging.getLogger(METRICS_LOGGER)
    handler = JsonlHandler(path)
    metrics.addHandler(handler)
    metrics.setLevel(logging.INFO)
    try:
        log_train_step(0, 0, 1e-3, {"loss": 2.0, "tokens": 10.0})
        log_validation(1, 0, {"loss_epoch": 1.5, "tau_sim": 1.2})
    finally:
        metrics.removeHandler(handler)
    with path.open("a") as handle:
        handle.write('[1, 2]\n{"step": 2, "train": {"lo')  # not an object; a torn line
    train, val = read_metrics(path)
    assert (train.step, train.epoch, train.lr, train.train, train.val) == (
        0,
        0,
        1e-3,
        {"loss": 2.0, "tokens": 10.0},
        None,
    )
    assert (val.step, val.epoch, val.lr, val.train, val.val) == (
        1,
        0,
        None,
        None,
        {"loss_epoch": 1.5, "tau_sim": 1.2},
    )
    assert path.read_text().splitlines()[0] == train.to_line()
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_truncation_keeps_what_the_checkpoint_kept(tmp_path):
    lines = [
        {"step": 0, "train": {"loss": 3.0}, "epoch": 0, "lr": 0.1},
        {"step": 1, "train": {"loss": 2.0}, "epoch": 0, "lr": 0.1},
        {"step": 2, "val": {"loss_epoch": 2.0}, "epoch": 0},
        {"step": 2, "train": {"loss": 1.0}, "epoch": 1, "lr": 0.1},
        {"note": "no step"},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "tr')
    MetricsLog(tmp_path).truncate_after(2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        lines[0],
        lines[1],
        lines[2],
        lines[4],
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    MetricsLog(tmp_path, rank=1).truncate_after(0)  # only rank 0 writes
    assert len(path.read_text().splitlines()) == 4


def test_a_run_from_scratch_moves_the_earlier_log_aside_and_back(tmp_path):
    log = MetricsLog(tmp_path)
    log.path.write_text("earlier\n")
    assert log.start(replaces_checkpoints=True)
    assert log.previous.read_text() == "earlier\n" and log.unconfirmed_marker.is_file()
    log.path.write_text("this run\n")
    assert MetricsLog(tmp_path).recover_unconfirmed_run()
    assert log.path.read_text() == "earlier\n" and log.previous.read_text() == "this run\n"
    assert not log.unconfirmed_marker.exists()
    assert not log.recover_unconfirmed_run()


def test_train_steps_as_flat_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "train": {"loss": 2.0, "tokens": 5}, "epoch": 0, "lr": 0.1}\n'
        '{"step": 2, "val": {"loss_epoch": 1.0}, "epoch": 0}\n'
    )
    assert read_train_steps(path) == [{"step": 1, "loss": 2.0, "tokens": 5}]
