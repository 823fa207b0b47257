"""`speculators datagen --ray-address`: shards as Ray tasks on a local Ray cluster.

The engine test runs two shards of the tiny Llama as Ray tasks, one of them killed (SIGKILL) once
after its first sample file, and compares the folder with an unsharded run file by file. The
others need no engine: how a task's resources are chosen, how the bar counts, and the run failing
on a shard that keeps dying or stops on a mistake, naming the shard and its log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speculators_vllm016.cli.datagen import main
from speculators_vllm016.data_generation import ray_shards
from speculators_vllm016.data_generation.manifest import ManifestWriter, SampleRecord, read_manifest
from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.ray_shards import (
    RAY_MISSING,
    FolderProgress,
    run_shards_on_ray,
    shard_resources,
)
from speculators_vllm016.data_generation.resume import STATE_FILE
from speculators_vllm016.data_generation.sample_io import load_sample
from speculators_vllm016.data_generation.token_counts import load_token_freq
from speculators_vllm016.demo import demo_conversations_path

REPO = Path(__file__).resolve().parents[2]
NUM_ROWS = 16
SETTINGS = {"seq_length": 255, "batch_size": 4, "dtype": "float32", "max_samples": NUM_ROWS}

# Loaded into every Python process of a test run (PYTHONPATH): the shard named by
# TEST_KILL_SHARD ("<index>:<marker file>") SIGKILLs itself right after its first sample file is
# renamed into place, once (the marker remembers it), or at its start on every attempt when
# TEST_KILL_AT_START is set (once the file TEST_KILL_WAITS_FOR exists, when that is set). The
# shard TEST_HOLD_SHARD never renames a sample file: it stays mid-run, engine up, until stopped.
KILL_HOOK = """
import os, signal, sys
_spec = os.environ.get("TEST_KILL_SHARD")
if _spec:
    _index, _marker = _spec.split(":", 1)
    _mine = "--shard-index=" + _index in sys.argv and "datagen" in sys.argv
    if _mine and os.environ.get("TEST_KILL_AT_START"):
        import time
        _wait = os.environ.get("TEST_KILL_WAITS_FOR")
        _deadline = time.monotonic() + 600
        while _wait and not os.path.exists(_wait) and time.monotonic() < _deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    _held = "--shard-index=" + os.environ.get("TEST_HOLD_SHARD", "-") in sys.argv
    _replace = os.replace
    def _replace_then_die(src, dst, *args, **kwargs):
        name = os.path.basename(str(dst))
        if _held and name.startswith("data_"):
            import time
            time.sleep(3600)
        result = _replace(src, dst, *args, **kwargs)
        if _mine and name.startswith("data_") and not os.path.exists(_marker):
            open(_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    os.replace = _replace_then_die
"""


# -- no Ray cluster needed ---------------------------------------------------------------------


def node(alive: bool = True, **resources: float) -> dict:
    return {"Alive": alive, "Resources": resources}


def test_a_shard_asks_for_tensor_times_pipeline_gpus_or_cpus_without_gpus():
    gpu_nodes = [node(CPU=128, GPU=8), node(CPU=128, GPU=8)]
    assert shard_resources(gpu_nodes, 8) == {"num_gpus": 8, "num_cpus": 1}
    assert shard_resources([node(CPU=4)], 2) == {"num_cpus": 2}


def test_a_shard_larger_than_every_live_node_is_refused():
    with pytest.raises(ValueError, match=r"needs 8 GPUs .* largest node .* has 4"):
        shard_resources([node(CPU=64, GPU=4), node(alive=False, CPU=64, GPU=8)], 8)
    with pytest.raises(ValueError, match=r"needs 4 CPUs"):
        shard_resources([node(CPU=2)], 4)


def test_the_bar_counts_the_samples_every_shard_lists_out_of_the_run_record(tmp_path):
    progress = FolderProgress(tmp_path, show=False)
    assert progress.counts() == (0, 0, None)
    for shard, indices in ((0, [0, 2]), (1, [1])):
        with ManifestWriter(tmp_path / "manifest" / f"shard-{shard}-of-2.jsonl") as writer:
            for index in indices:
                writer.append(SampleRecord(f"data_{index}.pt", index, 10 + index, 1, None))
    assert progress.counts() == (3, 33, None)  # the total is known once a shard recorded the run
    record = {"output_format": "pt", "start_idx": 0, "details": {"num_samples": 5}}
    (tmp_path / STATE_FILE).write_text(json.dumps(record))
    assert progress.counts() == (3, 33, 5)
    assert progress.refresh()
    assert (progress.bar.n, progress.bar.total) == (3, 5)
    # Unchanged counts are not drawn again (#50 item 10: `100%` about ten times).
    assert not progress.refresh() and not progress.refresh()
    progress.close()


def test_another_shard_count_is_refused_from_the_folders_record_before_ray(
    tmp_path, monkeypatch, capsys
):
    """#50 item 10: refused only after Ray and an engine started, leaving a shard's log."""
    output = tmp_path / "out"
    output.mkdir()
    (output / STATE_FILE).write_text(json.dumps({"version": 2, "num_shards": 3}))

    def no_ray():
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray_shards, "require_ray", no_ray)
    argv = ["--target-model-path", str(tmp_path), "--train-data-path", "d.jsonl"]
    code = main([*argv, "--output-dir", str(output), "--ray-address", "local", "--num-shards", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"error: --num-shards 2: --output-dir {output} holds a run of 3 shards"
    )
    assert sorted(p.name for p in output.iterdir()) == [STATE_FILE]


def test_without_ray_the_flag_says_how_to_install_it_and_nothing_is_written(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    output = tmp_path / "out"
    argv = ["--target-model-path", str(tmp_path), "--train-data-path", "d.jsonl"]
    code = main([*argv, "--output-dir", str(output), "--ray-address", "local", "--num-shards", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert RAY_MISSING in err[0] and "pip install 'speculators-vllm016[ray]'" in err[0]
    assert not output.exists()


def test_shard_index_is_refused_with_ray_address(tmp_path, capsys):
    output = tmp_path / "out"
    code = main(
        ["--target-model-path", str(tmp_path), "--train-data-path", "d.jsonl"]
        + ["--output-dir", str(output), "--ray-address", "local", "--shard-index", "1"]
        + ["--num-shards", "2"]
    )
    assert code == 2 and "leave out --shard-index" in capsys.readouterr().err
    assert not output.exists()


def test_an_address_nobody_listens_on_is_refused_at_once(tiny_llama, tmp_path, capsys):
    with socket.socket() as probe:  # a free port: bound, then closed again
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    output = tmp_path / "out"
    code = main(
        ["--target-model-path", str(tiny_llama), "--train-data-path", "d.jsonl"]
        + ["--output-dir", str(output), "--ray-address", f"127.0.0.1:{port}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"cannot reach the Ray cluster at --ray-address 127.0.0.1:{port}" in err[0]
    assert not output.exists()


# -- a local Ray cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    lines = demo_conversations_path().read_text().splitlines()[:NUM_ROWS]
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


class RunConnected(Exception):
    """Raised where the run would start its shards: the test needs Ray started, not the run."""


def test_the_callers_sigterm_handler_is_back_once_ray_is_down(
    tiny_llama, chats, tmp_path, monkeypatch
):
    """Ray's start-up (in this process) sets a SIGTERM handler of its own and its shutdown
    leaves it; the run puts the caller's back, and its own flag is the one set while it runs."""
    seen = {}

    def run_connected(*args: object) -> None:
        seen["during"] = signal.getsignal(signal.SIGTERM)
        raise RunConnected

    def callers(*_: object) -> None:
        pass

    monkeypatch.setattr(ray_shards, "_run_connected", run_connected)
    monkeypatch.setenv("RAY_DISABLE_USAGE_STATS", "1")
    options = DatagenOptions(
        target_model_path=str(tiny_llama),
        train_data_path=str(chats),
        output_dir=str(tmp_path / "out"),
        show_progress=False,
        **SETTINGS,
    )
    signal.signal(signal.SIGTERM, callers)  # the suite's fixture puts the default back
    with pytest.raises(RunConnected):
        run_shards_on_ray(options, "local")
    assert seen["during"] not in (callers, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) is callers


def ray_command(model: Path, chats: Path, output: Path, *extra: str) -> list[str]:
    """`speculators datagen --ray-address local` with the tiny model's settings."""
    return [
        sys.executable,
        "-m",
        "speculators_vllm016",
        "datagen",
        "--target-model-path",
        str(model),
        "--train-data-path",
        str(chats),
        "--output-dir",
        str(output),
        "--ray-address",
        "local",
        "--seq-length",
        str(SETTINGS["seq_length"]),
        "--batch-size",
        str(SETTINGS["batch_size"]),
        "--dtype",
        SETTINGS["dtype"],
        "--max-samples",
        str(NUM_ROWS),
        "--num-preprocessing-workers",
        "1",
        *extra,
    ]


def ray_environment(hooks: Path, **env: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hooks), str(REPO)]),
        "RAY_DISABLE_USAGE_STATS": "1",
        **env,
    }


def ray_datagen(model: Path, chats: Path, output: Path, tmp_path: Path, *extra: str, **env: str):
    """The command run to its end, with the test hooks loaded."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(KILL_HOOK)
    return subprocess.run(
        ray_command(model, chats, output, *extra),
        env=ray_environment(hooks, **env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )


def processes_tagged(tag: str) -> list[str]:
    """Command lines of this machine's processes whose environment holds TEST_RUN_TAG=tag."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if f"TEST_RUN_TAG={tag}".encode() in environment:
            found.append(command)
    return found


@pytest.mark.slow
def test_a_shard_that_keeps_dying_fails_the_run_naming_it_and_its_log(tiny_llama, chats, tmp_path):
    """Shard 0 dies at every start, once shard 1 is mid-run (its engine started and held): the
    run fails on shard 0 after its retries, and shard 1 is stopped with it: no process of the run
    (shard, engine, Ray) is left once the command has returned."""
    output = tmp_path / "out"
    result = ray_datagen(
        tiny_llama,
        chats,
        output,
        tmp_path,
        "--num-shards",
        "2",
        "--ray-max-retries",
        "1",
        TEST_KILL_SHARD=f"0:{tmp_path / 'never-used'}",
        TEST_KILL_AT_START="1",
        TEST_KILL_WAITS_FOR=str(output / STATE_FILE),  # recorded once an engine started
        TEST_HOLD_SHARD="1",
        TEST_RUN_TAG=str(tmp_path),
    )
    log = output / "logs" / "shard-0-of-2.log"
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "shard 0 of 2 failed 2 times (--ray-max-retries 1)" in last, result.stderr[-3000:]
    assert "killed by SIGKILL" in last and str(log) in last
    assert re.findall(r"=== shard 0, attempt (\d+),", log.read_text()) == ["1", "2"]
    assert re.findall(r"=== shard 1, attempt (\d+),", (log.parent / "shard-1-of-2.log").read_text())
    assert processes_tagged(str(tmp_path)) == []


@pytest.mark.slow
def test_sigterm_to_the_command_stops_it_cleanly_with_no_process_left(tiny_llama, chats, tmp_path):
    """A scheduler's SIGTERM to the command's process group while a shard is mid-run (engine up,
    held): the command says it stopped (143) and leaves no process of the run behind."""
    output = tmp_path / "out"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_HOOK)
    command = ray_command(tiny_llama, chats, output, "--num-shards", "1")
    environment = ray_environment(hooks, TEST_HOLD_SHARD="0", TEST_RUN_TAG=str(tmp_path))
    process = subprocess.Popen(
        command,
        env=environment,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900
        while not (output / STATE_FILE).exists():  # recorded once the shard's engine started
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the shard never started its engine"
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGTERM)
        stderr = process.communicate(timeout=300)[1]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("stopped: SIGTERM"), stderr[-3000:]
    assert processes_tagged(str(tmp_path)) == []


@pytest.mark.slow
def test_a_mistake_a_shard_finds_is_not_retried(tiny_llama, tmp_path):
    """The data file is read by the shards: its absence stops the first attempt for good."""
    output = tmp_path / "out"
    result = ray_datagen(tiny_llama, tmp_path / "missing.jsonl", output, tmp_path)
    log = output / "logs" / "shard-0-of-1.log"
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: shard 0 of 1 stopped: ") and str(log) in last, last
    assert "missing.jsonl" in last
    assert re.findall(r"=== shard 0, attempt (\d+),", log.read_text()) == ["1"]


def sample_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"data_\d+\.pt", p.name))


@pytest.mark.engine
def test_two_shard_tasks_one_killed_once_equal_the_unsharded_run(tiny_llama, chats, tmp_path):
    reference = tmp_path / "reference"
    run_datagen(
        DatagenOptions(
            target_model_path=str(tiny_llama),
            train_data_path=str(chats),
            output_dir=str(reference),
            num_preprocessing_workers=1,
            show_progress=False,
            **SETTINGS,
        )
    )
    output = tmp_path / "sharded"
    marker = tmp_path / "shard-1-was-killed"
    result = ray_datagen(
        tiny_llama,
        chats,
        output,
        tmp_path,
        "--num-shards",
        "2",
        TEST_KILL_SHARD=f"1:{marker}",
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert marker.exists(), "shard 1 was never killed"
    log = (output / "logs" / "shard-1-of-2.log").read_text()
    assert re.findall(r"=== shard 1, attempt (\d+),", log) == ["1", "2"]
    assert "attempt 1: exit status -9" in log
    summary = json.loads(result.stdout.strip().splitlines()[-1].removeprefix("SUMMARY "))
    assert summary["retries"] == 1 and summary["samples_total"] == NUM_ROWS
    assert summary["samples_written"] + summary["samples_already_present"] == NUM_ROWS
    assert f"{NUM_ROWS}/{NUM_ROWS}" in result.stderr  # the one bar reached every shard's samples

    assert sample_names(output) == sample_names(reference)
    for name in sample_names(reference):
        got, want = load_sample(output / name), load_sample(reference / name)
        assert torch.equal(got["input_ids"], want["input_ids"]), name
        assert torch.equal(got["loss_mask"], want["loss_mask"]), name
        for a, b in zip(got["hidden_states"], want["hidden_states"], strict=True):
            assert torch.equal(a, b), name
    assert sorted(read_manifest(output)) == sample_names(reference)
    assert load_token_freq(output) == load_token_freq(reference)
    assert not list((output / ".tmp").iterdir())
