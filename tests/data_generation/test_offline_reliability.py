"""Datagen under the set-ups users really have: shared folders, damaged or foreign files, changed
flags. One reference run (tiny Llama, the demo's conversations) serves every comparison.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.manifest import read_manifest
from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.sample_io import load_sample
from speculators_vllm016.data_generation.token_counts import load_token_freq, shard_token_freq_path
from speculators_vllm016.demo import demo_conversations_path
from tests.data_generation.shared_engine import datagen_engine
from tests.hf_reference import relative_error

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
NUM_ROWS = 16
SETTINGS = {"seq_length": 255, "batch_size": 4, "dtype": "float32", "max_samples": NUM_ROWS}


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    lines = demo_conversations_path().read_text().splitlines()[:NUM_ROWS]
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def options_for(model, chats, output, **overrides) -> DatagenOptions:
    values = dict(
        target_model_path=str(model),
        train_data_path=str(chats),
        output_dir=str(output),
        num_preprocessing_workers=1,
        show_progress=False,
        **SETTINGS,
    )
    values.update(overrides)
    return DatagenOptions(**values)


@pytest.fixture(scope="module")
def engine(tiny_llama, chats, tmp_path_factory):
    """The engine of every in-process run here that computes samples (they share SETTINGS)."""
    with datagen_engine(options_for(tiny_llama, chats, tmp_path_factory.mktemp("unused"))) as e:
        yield e


@pytest.fixture(scope="module")
def reference(tiny_llama, chats, tmp_path_factory, engine) -> Path:
    output = tmp_path_factory.mktemp("runs") / "reference"
    summary = run_datagen(options_for(tiny_llama, chats, output), generator=engine)
    assert summary.samples_written == NUM_ROWS
    return output


def sample_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"data_\d+\.pt", p.name))


def assert_same_samples(folder: Path, reference: Path, exact: bool) -> None:
    assert sample_names(folder) == sample_names(reference)
    for name in sample_names(reference):
        got, want = load_sample(folder / name), load_sample(reference / name)
        assert torch.equal(got["input_ids"], want["input_ids"]), name
        assert torch.equal(got["loss_mask"], want["loss_mask"]), name
        for a, b in zip(got["hidden_states"], want["hidden_states"], strict=True):
            assert torch.equal(a, b) if exact else relative_error(a, b) <= 1e-5, name


def copy_run(reference: Path, target: Path, samples_only: bool = False) -> Path:
    if samples_only:
        target.mkdir()
        for name in sample_names(reference):
            shutil.copy2(reference / name, target / name)
    else:
        shutil.copytree(reference, target)
    return target


# -- the lengths index -------------------------------------------------------------------------


def test_manifest_lists_every_whole_sample_with_its_length_size_and_hash(reference):
    import hashlib

    records = read_manifest(reference)
    assert sorted(records) == sample_names(reference)
    for name, record in records.items():
        path = reference / name
        assert record.file == name and record.index == int(name[5:].split(".")[0])
        assert record.length == len(load_sample(path)["input_ids"])
        assert record.bytes == path.stat().st_size
        assert record.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


# -- item 1: shards sharing one folder (docs/datagen.md's recipe) -----------------------------------

GATE_HOOK = """
import os, time
_gate = os.environ.get("TEST_RENAME_GATE")
if _gate:
    _replace = os.replace
    def _gated(src, dst, *args, **kwargs):
        # Hold every finished temporary file back until the test opens the gate.
        if "/.tmp/" in str(src) and str(src).endswith(".part"):
            deadline = time.monotonic() + 900
            while not os.path.exists(_gate) and time.monotonic() < deadline:
                time.sleep(0.05)
        return _replace(src, dst, *args, **kwargs)
    os.replace = _gated
"""


def _wait_for(condition, processes, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for process in processes:
            if process.poll() is not None:
                out = process.stdout.read() if process.stdout else ""
                pytest.fail(f"a shard exited ({process.returncode}) before {what}: {out[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _writers_with_pending_files(output: Path) -> set[str]:
    root = output / ".tmp"
    if not root.is_dir():
        return set()
    return {slot.name for slot in root.iterdir() if slot.is_dir() and list(slot.glob("*.part"))}


def test_two_shards_in_one_folder_both_finish_and_equal_the_unsharded_run(
    reference, tiny_llama, chats, tmp_path
):
    """docs/datagen.md's SLURM/Ray recipe, two shards, the second starting while the first writes."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(GATE_HOOK)
    gate = tmp_path / "open-the-gate"
    output = tmp_path / "shared"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hooks), str(REPO)]),
        "TEST_RENAME_GATE": str(gate),
        "PYTHONUNBUFFERED": "1",
    }

    def shard(index: int) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "speculators_vllm016",
            "datagen",
            "--target-model-path",
            str(tiny_llama),
            "--train-data-path",
            str(chats),
            "--output-dir",
            str(output),
            "--num-shards",
            "2",
            "--shard-index",
            str(index),
            # the tiny model's settings:
            "--seq-length",
            "255",
            "--batch-size",
            "4",
            "--dtype",
            "float32",
            "--max-samples",
            str(NUM_ROWS),
            "--num-preprocessing-workers",
            "1",
            "--no-progress",
        ]
        return subprocess.Popen(
            command,
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = shard(0)
    try:
        _wait_for(lambda: _writers_with_pending_files(output), [first], "shard 0 wrote")
        first_writer = _writers_with_pending_files(output)
        second = shard(1)
        # Shard 1 writes only after its start-up sweep of the folder: both are now mid-write.
        _wait_for(
            lambda: _writers_with_pending_files(output) - first_writer, [second], "shard 1 wrote"
        )
        gate.touch()
        outputs = [process.communicate(timeout=900)[0] for process in (first, second)]
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                process.kill()
    assert [first.returncode, second.returncode] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert_same_samples(output, reference, exact=False)
    assert sorted(read_manifest(output)) == sample_names(reference)
    assert sum(load_token_freq(output).values()) == sum(load_token_freq(reference).values())
    assert not list((output / ".tmp").iterdir())


# -- item 2: resume checks what is present -----------------------------------------------------


def test_damaged_files_are_recomputed_on_resume(reference, tiny_llama, chats, tmp_path, engine):
    folder = copy_run(reference, tmp_path / "damaged")
    half = (folder / "data_5.pt").read_bytes()
    (folder / "data_5.pt").write_bytes(half[: len(half) // 2])
    (folder / "data_6.pt").write_bytes(b"")
    untouched = (folder / "data_0.pt").stat().st_mtime_ns
    summary = run_datagen(options_for(tiny_llama, chats, folder), generator=engine)
    assert summary.samples_written == 2
    assert_same_samples(folder, reference, exact=True)
    assert (folder / "data_0.pt").stat().st_mtime_ns == untouched
    records = read_manifest(folder)
    assert records["data_5.pt"].bytes == (folder / "data_5.pt").stat().st_size


def test_a_resume_computes_only_the_missing_sample(
    reference, tiny_llama, chats, tmp_path, monkeypatch, engine
):
    """#37 item 19: one file of a finished run deleted; the rerun sends exactly that sample to
    the engine (not its whole batch of 4) and the folder equals the uninterrupted run, bit for bit."""
    from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator,
    )

    folder = copy_run(reference, tmp_path / "one-missing")
    (folder / "data_5.pt").unlink()
    sent: list[list[int]] = []
    real = VllmHiddenStatesGenerator.generate_stream

    def counting(self, token_ids):
        sent.extend(list(ids) for ids in token_ids)
        yield from real(self, token_ids)

    monkeypatch.setattr(VllmHiddenStatesGenerator, "generate_stream", counting)
    summary = run_datagen(options_for(tiny_llama, chats, folder), generator=engine)
    assert summary.samples_written == 1 and summary.samples_already_present == NUM_ROWS - 1
    assert sent == [load_sample(reference / "data_5.pt")["input_ids"].tolist()]
    assert_same_samples(folder, reference, exact=True)


def test_foreign_folder_is_refused_unless_adopted_and_then_checked(
    reference, tiny_llama, chats, tmp_path, engine
):
    folder = copy_run(reference, tmp_path / "unrecorded", samples_only=True)
    # Files of other data under this run's names, and a truncated one.
    zero, one = (folder / "data_0.pt").read_bytes(), (folder / "data_1.pt").read_bytes()
    (folder / "data_0.pt").write_bytes(one)
    (folder / "data_1.pt").write_bytes(zero)
    (folder / "data_2.pt").write_bytes(zero[:100])
    with pytest.raises(ValueError, match="no record of the run.*--adopt-existing"):
        run_datagen(options_for(tiny_llama, chats, folder))
    assert not (folder / "token_freq").exists() and not (folder / "manifest").exists()
    adopted = options_for(tiny_llama, chats, folder, adopt_existing=True)
    summary = run_datagen(adopted, generator=engine)
    assert summary.samples_written == 3
    assert_same_samples(folder, reference, exact=True)
    assert sorted(read_manifest(folder)) == sample_names(reference)


# -- items 4 and 5: token counts and the run identity ------------------------------------------


def test_token_counts_beside_the_data_readable_and_kept_when_a_run_is_refused(
    reference, tiny_llama, chats, tmp_path
):
    own = shard_token_freq_path(reference, 0, 1)
    assert own.is_file() and own.stat().st_mode & 0o044 == 0o044  # as the umask allows
    counts = load_token_freq(reference)
    assert counts and all(isinstance(k, int) for k in counts)
    before = own.read_bytes()
    explicit = tmp_path / "token_freq.pt"
    explicit.write_bytes(b"previous job")
    with pytest.raises(ValueError, match="different run"):
        run_datagen(
            options_for(tiny_llama, chats, reference, seq_length=128, token_freq_path=str(explicit))
        )
    assert own.read_bytes() == before
    assert explicit.read_bytes() == b"previous job"
    assert not (Path.cwd() / "token_freq.pt").exists()


def test_identity_compares_what_goes_into_the_samples(reference, tiny_llama, chats, monkeypatch):
    # Loss mask only: another assistant pattern changes every sample's mask.
    with pytest.raises(ValueError, match="different run.*samples_sha256.*assistant_pattern"):
        run_datagen(options_for(tiny_llama, chats, reference, assistant_pattern="(.*)"))
    # The same run written differently: relative model path, default layers spelled out.
    monkeypatch.chdir(Path(tiny_llama).parent)
    layers = json.loads((Path(tiny_llama) / "config.json").read_text())["num_hidden_layers"]
    spelled = [2, layers // 2, layers - 3, layers - 1]
    summary = run_datagen(
        options_for(f"./{Path(tiny_llama).name}", chats, reference, layer_ids=spelled)
    )
    assert summary.samples_written == 0 and summary.samples_already_present == NUM_ROWS


# -- #29 item 6: training refuses a folder its datagen run has not finished ---------------------


def test_a_folder_missing_samples_is_refused_by_training_until_datagen_finishes_it(
    reference, tiny_llama, chats, tmp_path, engine
):
    from speculators_vllm016.train.data import IncompleteDataError, list_files

    folder = copy_run(reference, tmp_path / "unfinished")
    (folder / "data_7.pt").unlink()
    (folder / "data_12.pt").unlink()
    with pytest.raises(IncompleteDataError, match=r"lacks 2 of the 16 .*\(data_7.pt, data_12.pt\)"):
        list_files(folder)
    summary = run_datagen(options_for(tiny_llama, chats, folder), generator=engine)  # again
    assert summary.samples_written == 2
    assert len(list_files(folder)) == NUM_ROWS
