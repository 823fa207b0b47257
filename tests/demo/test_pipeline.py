"""The demo summary's training throughput: right after a resumed training call too."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.demo.pipeline import read_training_metrics, training_throughput


def _write_metrics(path, tokens_per_step: list[int]) -> None:
    """metrics.jsonl as the trainer writes it: one train line per step, a validation line."""
    lines = [
        {"step": step, "train": {"loss": 1.0, "full_acc_0": 0.5, "tokens": tokens,
                                 "step_seconds": 0.5}, "epoch": 0, "lr": 1e-3}
        for step, tokens in enumerate(tokens_per_step)
    ]
    lines.append({"step": len(tokens_per_step), "val": {"loss_epoch": 1.0}, "epoch": 0})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_resumed_run_is_timed_by_its_steps_not_by_the_last_call(tmp_path):
    # Ten steps of 100 tokens, 0.5 s each: 200 tokens/s. The resumed call ran only the last
    # three steps (1.5 s), which must not become 1000 tokens / 1.5 s.
    metrics_file = tmp_path / "metrics.jsonl"
    _write_metrics(metrics_file, [100] * 10)
    metrics = read_training_metrics(metrics_file)
    tokens, rate = training_throughput(metrics, call_seconds=1.5)
    assert tokens == 1000
    assert rate == pytest.approx(200.0)


def test_lines_without_step_times_fall_back_to_the_call_time():
    tokens, rate = training_throughput([{"step": 0, "tokens": 300}], call_seconds=3.0)
    assert (tokens, rate) == (300, pytest.approx(100.0))
    assert training_throughput([], call_seconds=0.0) == (0, 0.0)
