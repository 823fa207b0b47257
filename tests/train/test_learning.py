"""The draft learns from what datagen extracts: loss falls and accuracy rises (real engine, CPU)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from speculators_vllm016.cli.train import main
from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.demo import build_demo_model, demo_conversations_path


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("demo_datagen")
    model = build_demo_model(root / "model")
    options = DatagenOptions(
        target_model_path=str(model),
        train_data_path=str(demo_conversations_path()),
        output_dir=str(root / "data"),
        seq_length=256,
        max_samples=96,
        hf_cache_dir=str(root / "hf-cache"),
        num_preprocessing_workers=1,
        show_progress=False,
    )
    summary = run_datagen(options)
    assert summary.describe()
    return model, root / "data"


@pytest.mark.engine
def test_loss_falls_and_accuracy_rises_on_datagen_output(demo_data, tmp_path):
    model, data = demo_data
    save = tmp_path / "ckpt"
    argv = [
        "--verifier-name-or-path",
        str(model),
        "--data-path",
        str(data),
        "--save-path",
        str(save),
        "--d2t-path",
        str(tmp_path / "d2t.npy"),
        "--t2d-path",
        str(tmp_path / "t2d.npy"),
        "--draft-vocab-size",
        "256",
        "--total-seq-len",
        "1024",
        "--epochs",
        "3",
        "--lr",
        "3e-3",
        "--num-workers",
        "0",
        "--no-progress",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    assert main(argv) == 0
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "train" in line]
    by_epoch: dict[int, list[dict]] = {}
    for line in train:
        by_epoch.setdefault(line["epoch"], []).append(line["train"])
    first, last = by_epoch[0], by_epoch[max(by_epoch)]
    loss = [statistics.mean(step["loss"] for step in epoch) for epoch in (first, last)]
    acc = [statistics.mean(step["full_acc_0"] for step in epoch) for epoch in (first, last)]
    assert loss[1] < 0.8 * loss[0], loss
    assert acc[1] > acc[0] + 0.03, acc
    # Held-out rows too: the validation loss falls (the random demo target makes its top-1
    # agreement too noisy to compare on ten samples).
    val = [line["val"] for line in lines if "val" in line]
    assert val[-1]["loss_epoch"] < val[0]["loss_epoch"]
