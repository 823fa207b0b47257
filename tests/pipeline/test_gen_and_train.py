"""gen-and-train's chain on the runner: which stage runs again, in the words users read.

Datagen and training are stand-ins here (the real chain, killed and resumed, is
tests/cli/test_gen_and_train.py's engine test); the vocabulary maps are built for real.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speculators_vllm016.cli.gen_and_train import plan_from_argv
from speculators_vllm016.data_generation import offline
from speculators_vllm016.data_generation.token_counts import save_token_counts
from speculators_vllm016.pipeline.gen_and_train import DATAGEN_DONE, run_gen_and_train
from speculators_vllm016.utils.errors import InvalidInputError


def _argv(root: Path, *extra: str) -> list[str]:
    return [
        "--target-model-path",
        "model",
        "--train-data-path",
        "chat.jsonl",
        "--output-dir",
        str(root),
        "--draft-vocab-size",
        "16",
        "--target-vocab-size",
        "64",
        *extra,
    ]


@pytest.fixture
def stand_ins(monkeypatch):
    """Datagen writes token counts (or fails on request); training notes that it started."""
    calls: dict[str, list] = {"datagen": [], "train": []}
    failing = []

    def datagen(options):
        if failing:
            raise InvalidInputError("the chat file has no usable row")
        calls["datagen"].append(options.max_samples)
        folder = Path(options.output_dir)
        save_token_counts({i: 100 - i for i in range(40)}, folder / "token_freq/shard-0-of-1.pth")
        return offline.DatagenSummary(str(folder), 4, 4, 0, 40, 1.0, 0.5)

    def train(config) -> int:
        calls["train"].append(config.checkpoint.save_path)
        return 0

    monkeypatch.setattr(offline, "run_datagen", datagen)
    return calls, train, failing


def test_a_rerun_skips_done_stages_and_datagen_running_again_rebuilds_the_maps(
    tmp_path, capsys, stand_ins
):
    calls, train, _ = stand_ins
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    out = capsys.readouterr().out
    assert f"[1/3] datagen -> {tmp_path / 'data'}" in out
    assert f"[2/3] vocabulary maps: 16 of 64 tokens -> {tmp_path / 'vocab'}" in out
    assert f"[3/3] training -> {tmp_path / 'checkpoints'}" in out
    assert (tmp_path / "data" / DATAGEN_DONE).is_file()
    assert len(np.load(tmp_path / "vocab" / "d2t.npy")) == 16

    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    out = capsys.readouterr().out
    assert "[1/3] datagen: done earlier" in out and "[2/3] vocabulary maps: done earlier" in out
    assert calls["datagen"] == [None] and len(calls["train"]) == 2  # training always starts

    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, "--max-samples", "3")), train) == 0
    out = capsys.readouterr().out
    assert calls["datagen"] == [None, 3]
    assert "vocabulary maps in" in out and "building them again (datagen ran again)" in out


def test_a_failed_datagen_is_one_line_and_neither_recorded_nor_followed_by_training(
    tmp_path, capsys, stand_ins
):
    calls, train, failing = stand_ins
    failing.append(True)
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 2
    assert "the chat file has no usable row" in capsys.readouterr().err
    assert not (tmp_path / "data" / DATAGEN_DONE).exists()
    assert calls["train"] == [] and not (tmp_path / "vocab").exists()
