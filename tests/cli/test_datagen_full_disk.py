"""A disk that fills during datagen: one line naming the problem, exit 2, only whole files left."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from speculators_vllm016.cli.datagen import main
from speculators_vllm016.demo import demo_conversations_path


@pytest.fixture
def small_disk(tmp_path) -> Path:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.engine
def test_full_disk_is_one_line_and_leaves_only_whole_files(
    small_disk, tiny_llama, tmp_path, capsys
):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:40]) + "\n")
    output = small_disk / "data"
    code = main(
        [
            "--target-model-path",
            str(tiny_llama),
            "--train-data-path",
            str(chats),
            "--output-dir",
            str(output),
            "--seq-length",
            "256",
            "--num-preprocessing-workers",
            "1",
            "--hf-cache-dir",
            str(tmp_path / "datasets-cache"),
            "--no-progress",
            "--dtype",
            "float32",
        ]
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and "disk is full" in lines[0], err[-3000:]
    assert "Traceback" not in err
    samples = sorted(output.glob("data_*.pt"))
    assert samples, "the disk should have held a few samples before filling"
    for path in samples:  # whatever is under a final name is whole
        sample = torch.load(path, weights_only=True)
        assert len(sample["hidden_states"]) == 4 and sample["input_ids"].shape[0] > 0
