"""`speculators datagen` end to end on the real engine: content, shards, crash and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.sample_io import load_sample
from speculators_vllm016.demo import demo_conversations_path
from tests.data_generation.shared_engine import datagen_engine
from tests.data_generation.test_preprocessing import runs_of_ones
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
        "--target-model-path",
        options.target_model_path,
        "--train-data-path",
        options.train_data_path,
        "--output-dir",
        options.output_dir,
        "--seq-length",
        str(options.seq_length),
        "--batch-size",
        str(options.batch_size),
        "--dtype",
        options.dtype,
        "--token-freq-path",
        options.token_freq_path,
        "--hf-cache-dir",
        options.hf_cache_dir,
        "--num-preprocessing-workers",
        "1",
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def engine(tiny_llama, chat_file, tmp_path_factory):
    """The engine of every in-process run here that computes samples (one engine setting)."""
    unused = tmp_path_factory.mktemp("unused") / "out"
    with datagen_engine(options_for(tiny_llama, chat_file, unused)) as started:
        yield started


@pytest.fixture(scope="module")
def reference_run(tiny_llama, chat_file, tmp_path_factory, engine):
    output = tmp_path_factory.mktemp("runs") / "reference"
    summary = run_datagen(options_for(tiny_llama, chat_file, output), generator=engine)
    return output, summary


def sample_files(directory: Path) -> list[str]:
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.name.startswith("data_") and p.suffix in (".pt", ".safetensors")
    )


def assert_same_dataset(directory: Path, reference: Path) -> None:
    """Same file names, no leftovers, and every tensor bit-identical."""
    assert sample_files(directory) == sample_files(reference)
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    for name in sample_files(reference):
        got, want = load_sample(directory / name), load_sample(reference / name)
        assert torch.equal(got["input_ids"], want["input_ids"]), name
        assert torch.equal(got["loss_mask"], want["loss_mask"]), name
        assert len(got["hidden_states"]) == len(want["hidden_states"]), name
        for layer, (a, b) in enumerate(zip(got["hidden_states"], want["hidden_states"])):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} layer {layer} differs"


def test_run_writes_every_usable_row_and_its_config(reference_run, tiny_llama):
    from speculators_vllm016.utils.verifier_weights import verifier_fingerprint

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
    # The target's identity, which training and eval compare with their verifier (#37).
    assert config["model"]["verifier_fingerprint"] == verifier_fingerprint(str(tiny_llama))
    assert summary.tokens_extracted > 0 and summary.tokens_per_second > 0


def test_an_unsharded_run_writes_its_counts_exactly_at_token_freq_path(reference_run):
    # --token-freq-path X of a run with one shard is X itself (0.3.0's file), no shard suffix.
    from speculators_vllm016.data_generation.token_counts import load_token_freq, read_token_counts

    output, _ = reference_run
    wanted = output.parent / f"{output.name}_token_freq.pt"  # what `options_for` passes
    written = sorted(
        p.name for p in output.parent.iterdir() if p.name.startswith(output.name + "_")
    )
    assert written == [wanted.name]
    counts = read_token_counts(wanted)
    assert counts and counts == load_token_freq(output)  # the run's own counts


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


def test_sample_ids_and_masks_are_the_preprocessing_output_row_by_row(
    reference_run, tiny_llama, chat_file, tmp_path
):
    """Each file's `input_ids` and `loss_mask` equal preprocessing's row, token by token, and
    the masked tokens decode to the assistant turns of the source conversation."""
    from transformers import AutoTokenizer

    from speculators_vllm016.data_generation.conversations import normalize_conversation
    from speculators_vllm016.data_generation.preprocessing import load_and_preprocess_dataset

    output, _ = reference_run
    options = options_for(tiny_llama, chat_file, output)
    dataset, _ = load_and_preprocess_dataset(
        options.target_model_path,
        options.train_data_path,
        seq_length=options.seq_length,
        build_dataset_num_proc=1,
        token_freq_path=str(tmp_path / "token_freq.pt"),
        cache_dir=options.hf_cache_dir,
    )
    assert len(dataset) == len(sample_files(output))
    for index, row in enumerate(dataset):
        sample = load_sample(output / f"data_{index}.pt")
        assert sample["input_ids"].tolist() == row["input_ids"].tolist(), f"data_{index}.pt ids"
        assert sample["loss_mask"].tolist() == row["loss_mask"].tolist(), f"data_{index}.pt mask"

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    rows = chat_file.read_text().splitlines()
    for index in (0, 1, 7, 40, 93):
        row = dataset[index]
        ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
        turns = normalize_conversation(json.loads(rows[int(row["source_row"])])["conversations"])
        expected = [t["content"].strip() + "<|eot_id|>" for t in turns if t["role"] == "assistant"]
        decoded = [tokenizer.decode(ids[a:b]) for a, b in runs_of_ones(mask)]
        assert decoded, f"row {index} has no trained token"
        truncated = len(ids) == options.seq_length
        assert decoded[:-1] == expected[: len(decoded) - 1], f"row {index}"
        if truncated:
            assert expected[len(decoded) - 1].startswith(decoded[-1].rstrip("\ufffd")), (
                f"row {index}"
            )
        else:
            assert decoded == expected, f"row {index}"


def test_shards_together_equal_the_unsharded_run(
    reference_run, tiny_llama, chat_file, tmp_path, engine
):
    """Shards run one after another on one engine: their split and numbering are the guarantee
    here (shards in parallel processes: test_offline_reliability)."""
    reference, _ = reference_run
    sharded = tmp_path / "sharded"
    written = 0
    for shard in range(3):
        summary = run_datagen(
            options_for(tiny_llama, chat_file, sharded, num_shards=3, shard_index=shard),
            generator=engine,
        )
        written += summary.samples_written
    assert written == NUM_ROWS - len(MALFORMED)
    assert_same_dataset(sharded, reference)


def test_sessions_are_sharded_samples_that_hold_the_models_hidden_states(
    tiny_llama, chat_file, tmp_path, engine
):
    """`--session-tokens 255 --sessions-only` (sessions of whole pairs chained from several
    conversations) in 2 shards on the module's engine: the files are preprocessing's sessions,
    each once, and their states are transformers' on the same weights."""
    from speculators_vllm016.data_generation.preprocessing import load_and_preprocess

    flags = dict(session_tokens=255, sessions_only=True)
    output = tmp_path / "sessions"
    for shard in range(2):
        options = options_for(tiny_llama, chat_file, output, num_shards=2, shard_index=shard)
        run_datagen(DatagenOptions.from_fields({**vars_of(options), **flags}), generator=engine)
    sessions = load_and_preprocess(
        str(tiny_llama),
        str(chat_file),
        255,
        build_dataset_num_proc=1,
        token_freq_path=None,
        cache_dir=options.hf_cache_dir,
        **flags,
    ).dataset
    assert len(sessions) >= 2 and sample_files(output) == [
        f"data_{i}.pt" for i in range(len(sessions))
    ]
    recorded = json.loads((output / "data_config.json").read_text())["data"]
    assert recorded["session_tokens"] == 255 and recorded["sessions_only"] is True
    reference = HFReference(tiny_llama)
    for index, row in enumerate(sessions):
        sample = load_sample(output / f"data_{index}.pt")
        ids = sample["input_ids"].tolist()
        assert (
            ids == row["input_ids"].tolist()
            and sample["loss_mask"].tolist() == row["loss_mask"].tolist()
        )
        assert len(runs_of_ones(sample["loss_mask"].tolist())) >= 2  # two answers at least
        for layer, got, want in zip(
            [2, 2, 1, 3], sample["hidden_states"], reference.streams(ids, [2, 2, 1, 3])
        ):
            assert relative_error(got, want) <= 1e-4, f"session {index} layer {layer}"


def vars_of(options: DatagenOptions) -> dict:
    """The flat flags of `options` (the inverse of `DatagenOptions.from_fields`)."""
    from dataclasses import asdict

    return {
        name: value
        for part in (options.engine, options.preprocessing, options.output)
        for name, value in asdict(part).items()
    }


def partly_written_batches(
    directory: Path, batch_size: int, total: int, missing: int = 1
) -> list[int]:
    """Batches (by number) of which some files exist and at least `missing` do not."""
    present = {int(name[len("data_") : -len(".pt")]) for name in sample_files(directory)}
    batches = [
        range(start, min(start + batch_size, total)) for start in range(0, total, batch_size)
    ]
    return [
        number
        for number, batch in enumerate(batches)
        if 0 < sum(i in present for i in batch) <= len(batch) - missing
    ]


def kill_when(process: subprocess.Popen, ready, timeout: float = 300.0) -> None:
    """SIGKILL `process` as soon as `ready()` holds; fail if it ends or times out first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, "the run finished before it could be killed"
        assert time.monotonic() < deadline, "the run never reached the state to kill it in"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)


# `python -m speculators_vllm016 datagen ...` with every sample rename 0.1 s late, so that files
# appear one by one and a kill can be timed on the files on disk (the code is otherwise unchanged).
_SLOW_RENAMES = """
import os, runpy, sys, time
real_replace = os.replace
def replace(src, dst, *args, **kwargs):
    if os.path.basename(dst).startswith("data_"):
        time.sleep(0.1)
    return real_replace(src, dst, *args, **kwargs)
os.replace = replace
sys.argv = ["speculators_vllm016", *sys.argv[1:]]
runpy.run_module("speculators_vllm016", run_name="__main__", alter_sys=True)
"""


def test_killed_runs_resume_to_the_uninterrupted_result(
    reference_run, tiny_llama, chat_file, tmp_path
):
    """Killed (SIGKILL) twice part-way through a batch, then resumed: the same files as one run.

    Each kill waits for files on disk, not for a timer: the first comes once some batch is partly
    written, the second once a later one is; the dataset must be incomplete at each kill.
    """
    reference, _ = reference_run
    total = NUM_ROWS - len(MALFORMED)
    options = options_for(tiny_llama, chat_file, tmp_path / "killed")
    output = Path(options.output_dir)
    command = [sys.executable, "-m", "speculators_vllm016", "datagen", *cli_args(options)]
    slow = [
        sys.executable,
        "-c",
        _SLOW_RENAMES,
        "datagen",
        *cli_args(options),
        "--num-writer-threads",
        "1",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    partial_at_kill = []
    for minimum in (1, total // 2):

        def ready() -> bool:
            if not output.exists() or len(sample_files(output)) < minimum:  # noqa: B023 - called in this iteration
                return False
            # Two files short: one more rename before the kill lands cannot complete the batch.
            return bool(partly_written_batches(output, options.batch_size, total, missing=2))

        process = subprocess.Popen(
            slow, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        kill_when(process, ready)
        files = sample_files(output)
        assert minimum <= len(files) < total, f"{len(files)} files at the kill"
        partial_at_kill.append(partly_written_batches(output, options.batch_size, total))
        assert partial_at_kill[-1], "no batch was cut short by the kill"
        # Whatever is under a final name is whole.
        for name in files:
            load_sample(output / name)
    present_before_resume = len(sample_files(output))

    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads(
        next(line for line in completed.stdout.splitlines() if line.startswith("SUMMARY "))[
            len("SUMMARY ") :
        ]
    )
    assert summary["samples_already_present"] == present_before_resume > 0
    assert summary["samples_written"] == total - present_before_resume
    assert_same_dataset(output, reference)


def test_resume_of_a_finished_run_does_nothing_and_a_different_run_is_refused(
    reference_run, tiny_llama, chat_file
):
    reference, _ = reference_run
    before = {name: (reference / name).stat().st_mtime_ns for name in sample_files(reference)}
    summary = run_datagen(options_for(tiny_llama, chat_file, reference))
    assert summary.samples_written == 0
    assert summary.samples_already_present == NUM_ROWS - len(MALFORMED)
    assert {
        name: (reference / name).stat().st_mtime_ns for name in sample_files(reference)
    } == before
    with pytest.raises(ValueError, match="different run.*seq_length"):
        run_datagen(options_for(tiny_llama, chat_file, reference, seq_length=128))


def test_fp8_storage_holds_the_bf16_runs_states_within_the_fp8_bound_and_is_not_mixed(
    reference_run, tiny_llama, chat_file, tmp_path, engine
):
    """`--storage-dtype fp8` on the real engine: the same samples as the bf16 run within the
    stated bound, half the bytes, recorded in data_config.json; a bf16 resume is refused."""
    from speculators_vllm016.data_generation.config_generator import read_data_config
    from speculators_vllm016.utils.fp8_storage import error_bound

    reference, _ = reference_run
    output = tmp_path / "fp8"
    run_datagen(options_for(tiny_llama, chat_file, output, storage_dtype="fp8"), generator=engine)
    assert sample_files(output) == sample_files(reference)
    assert read_data_config(output).format.storage_dtype == "fp8"
    assert read_data_config(reference).format.storage_dtype == "bf16"
    for name in sample_files(reference):
        got, want = load_sample(output / name), load_sample(reference / name)
        stored = load_sample(output / name, dequantize=False)
        assert torch.equal(got["input_ids"], want["input_ids"]), name
        assert torch.equal(got["loss_mask"], want["loss_mask"]), name
        for a, b, scale in zip(
            got["hidden_states"], want["hidden_states"], stored["hidden_states_scale"], strict=True
        ):
            assert a.dtype == b.dtype == torch.float32
            assert ((a - b).abs() <= error_bound(b, scale)).all(), name
    fp8_bytes = sum((output / n).stat().st_size for n in sample_files(output))
    bf16_bytes = sum((reference / n).stat().st_size for n in sample_files(reference))
    assert fp8_bytes < 0.3 * bf16_bytes + 2048 * len(sample_files(output))  # 1 byte vs float32's 4
    before = {n: (output / n).stat().st_mtime_ns for n in sample_files(output)}
    with pytest.raises(ValueError, match="storage_dtype: was 'fp8', now 'bf16'"):
        run_datagen(options_for(tiny_llama, chat_file, output))
    assert {n: (output / n).stat().st_mtime_ns for n in sample_files(output)} == before
