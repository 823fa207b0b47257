"""`speculators train` on a folder written with `--storage-dtype fp8`: it trains, without a flag,
on states within the fp8 bound of the bf16 folder's: the first step's loss is that of bf16 data
within a small margin, and the run ends with a checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from speculators_vllm016.cli.train import main
from speculators_vllm016.data_generation.sample_io import load_sample, write_sample
from tests.training_fixtures import FIXED_SCHEDULE, train_args


def fp8_copy(data: Path, out: Path) -> Path:
    """The folder as datagen with --storage-dtype fp8 would have written the same states."""
    shutil.copytree(data, out, ignore=shutil.ignore_patterns("data_*.pt"))
    for path in sorted(data.glob("data_*.pt")):
        write_sample(out / path.name, load_sample(path), storage_dtype="fp8")
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(data.parent / name, out.parent / name)
    return out


def first_losses(save: Path) -> list[float]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r["train"]["loss"] for r in records if "loss" in r.get("train", {})][:3]


def test_a_fp8_folder_trains_like_its_bf16_source(tiny_llama, training_data, tmp_path):
    fp8 = fp8_copy(training_data, tmp_path / "fp8" / "data")
    assert "hidden_states_fp8" in load_sample(fp8 / "data_0.pt", dequantize=False)
    runs = {}
    for name, data in (("bf16", training_data), ("fp8", fp8)):
        save = tmp_path / f"save-{name}"
        assert main(train_args(tiny_llama, data, save, "--epochs", "1", *FIXED_SCHEDULE)) == 0
        assert (save / "0" / "model.safetensors").is_file()
        runs[name] = first_losses(save)
    assert len(runs["fp8"]) == len(runs["bf16"]) > 0
    for exact, stored in zip(runs["bf16"], runs["fp8"], strict=True):
        assert abs(exact - stored) <= 0.02 * abs(exact), runs
    assert runs["bf16"] != runs["fp8"]  # the fp8 states were trained on, not the bf16 ones
