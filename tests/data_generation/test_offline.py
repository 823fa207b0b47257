"""`speculators datagen` end to end on the real engine: content, shards, crash and resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.offline import DatagenOptions, run_datagen
from speculators_vllm016.data_generation.sample_io import load_sample
from speculators_vllm016.demo import demo_conversations_path
from tests.hf_reference import HFReference, relative_error

pytestmark = pytest.mark.engine

NUM_ROWS = 96
MALFORMED = [
    {"conversations": [{"from": "human", "value": "a question nobody answers"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},
]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    lines = demo_conversations_path().read_text().splitlines()[: NUM_ROWS - len(MALFORMED)]
    lines += [json.dumps(row) for row in MALFORMED]
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def options_for(tiny_llama, chat_file, output_dir, **overrides) -> DatagenOptions:
    base = dict(
        target_model_path=str(tiny_llama),
        train_data_path=str(chat_file),
        output_dir=str(output_dir),
        seq_length=255,
        batch_size=8,
        dtype="float32",
        token_freq_path=str(Path(output_dir).parent / f"{Path(output_dir).name}_token_freq.pt"),
        hf_cache_dir=str(Path(output_dir).parent / "datasets_cache"),
        num_preprocessing_workers=1,
        show_progress=False,
    )
    base.update(overrides)
    return DatagenOptions(**base)


def cli_args(options: DatagenOptions) -> list[str]:
    return [
        "--target-model-path", options.target_model_path,
        "--train-data-path", options.train_data_path,
        "--output-dir", options.output_dir,
        "--seq-length", str(options.seq_length),
        "--batch-size", str(options.batch_size),
        "--dtype", options.dtype,
        "--token-freq-path", options.token_freq_path,
        "--hf-cache-dir", options.hf_cache_dir,
        "--num-preprocessing-workers", "1",
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def reference_run(tiny_llama, chat_file, tmp_path_factory):
    output = tmp_path_factory.mktemp("runs") / "reference"
    summary = run_datagen(options_for(tiny_llama, chat_file, output))
    return output, summary


def sample_files(directory: Path) -> list[str]:
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.name.startswith("data_") and p.suffix in (".pt", ".safetensors")
    )


def assert_same_dataset(directory: Path, reference: Path, exact: bool) -> None:
    assert sample_files(directory) == sample_files(reference)
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    for name in sample_files(reference):
        got, want = load_sample(directory / name), load_sample(reference / name)
        assert torch.equal(got["input_ids"], want["input_ids"]), name
        assert torch.equal(got["loss_mask"], want["loss_mask"]), name
        for layer, (a, b) in enumerate(zip(got["hidden_states"], want["hidden_states"])):
            if exact:
                assert torch.equal(a, b), f"{name} layer {layer} differs"
            else:
                assert relative_error(a, b) <= 1e-5, f"{name} layer {layer}"


def test_run_writes_every_usable_row_and_its_config(reference_run):
    output, summary = reference_run
    usable = NUM_ROWS - len(MALFORMED)
    assert summary.skipped_rows == len(MALFORMED)
    assert summary.samples_written == usable and summary.samples_total == usable
    assert sample_files(output) == sorted(f"data_{i}.pt" for i in range(usable))
    config = json.loads((output / "data_config.json").read_text())
    assert config["version"] == "2.0"
    assert config["format"]["file_pattern"] == "data_{idx}.pt"
    assert config["format"]["data_format_version"] == 1
    assert config["hidden_states"]["layer_ids"] == [2, 2, 1, 3]  # 0.3.0 defaults, 4 layers
    assert config["data"]["num_samples"] == usable
    assert config["model"]["hidden_size"] == 256
    assert summary.tokens_extracted > 0 and summary.tokens_per_second > 0


def test_samples_hold_the_models_hidden_states(reference_run, tiny_llama):
    output, _ = reference_run
    reference = HFReference(tiny_llama)
    for index in (0, 7, 40, 93):
        sample = torch.load(output / f"data_{index}.pt", weights_only=True, mmap=True)
        ids = sample["input_ids"].tolist()
        assert sample["loss_mask"].shape == sample["input_ids"].shape
        assert 0 < int(sample["loss_mask"].sum()) < len(ids)
        expected = reference.streams(ids, [2, 2, 1, 3])
        for layer, got, want in zip([2, 2, 1, 3], sample["hidden_states"], expected):
            assert got.dtype == torch.float32
            assert relative_error(got, want) <= 1e-4, f"sample {index} layer {layer}"


def test_shards_together_equal_the_unsharded_run(reference_run, tiny_llama, chat_file, tmp_path):
    reference, _ = reference_run
    sharded = tmp_path / "sharded"
    written = 0
    for shard in range(3):
        summary = run_datagen(
            options_for(tiny_llama, chat_file, sharded, num_shards=3, shard_index=shard)
        )
        written += summary.samples_written
    assert written == NUM_ROWS - len(MALFORMED)
    # Shards batch other rows together, so float32 results may differ in the last bits.
    assert_same_dataset(sharded, reference, exact=False)


def test_killed_runs_resume_to_the_uninterrupted_result(reference_run, tiny_llama, chat_file, tmp_path):
    reference, _ = reference_run
    options = options_for(tiny_llama, chat_file, tmp_path / "killed")
    command = [sys.executable, "-m", "speculators_vllm016", "datagen", *cli_args(options)]
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kills = 0
    for delay in sorted(rng.uniform(4.0, 22.0) for _ in range(3)):
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait(timeout=60)
        # Whatever is under a final name is whole.
        for name in sample_files(Path(options.output_dir)) if Path(options.output_dir).exists() else []:
            load_sample(Path(options.output_dir) / name)
    assert kills >= 1, "every run finished before it could be killed"
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "SUMMARY" in completed.stdout
    assert_same_dataset(Path(options.output_dir), reference, exact=True)


def test_resume_of_a_finished_run_does_nothing_and_a_different_run_is_refused(
    reference_run, tiny_llama, chat_file
):
    reference, _ = reference_run
    before = {name: (reference / name).stat().st_mtime_ns for name in sample_files(reference)}
    summary = run_datagen(options_for(tiny_llama, chat_file, reference))
    assert summary.samples_written == 0
    assert summary.samples_already_present == NUM_ROWS - len(MALFORMED)
    assert {name: (reference / name).stat().st_mtime_ns for name in sample_files(reference)} == before
    with pytest.raises(ValueError, match="different run.*seq_length"):
        run_datagen(options_for(tiny_llama, chat_file, reference, seq_length=128))
