"""One shard attempt as its own process: the flags it gets, its log, and how its end is read."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from speculators_vllm016.cli.datagen import build_parser, options_from_args
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.shard_process import (
    AttemptResult,
    _summary_and_error,
    run_shard_attempt,
    shard_arguments,
    shard_log_path,
)
from speculators_vllm016.utils.command_errors import error_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_option_reaches_the_shard_through_its_flag():
    """Parsing a shard's flags gives back the job's options with the shard's own index, for a
    job that sets every option away from its default (a dropped flag would silently revert)."""
    job = DatagenOptions(
        target_model_path="/models/m",
        tensor_parallel_size=8,
        pipeline_parallel_size=2,
        max_model_len=5000,
        gpu_memory_utilization=0.9,
        dtype="bfloat16",
        max_num_seqs=64,
        max_num_batched_tokens=16384,
        trust_remote_code=True,
        transfer_root="/scratch/shm",
        train_data_path="data.jsonl",
        seq_length=4096,
        max_samples=500,
        hf_cache_dir="/cache",
        assistant_pattern="-?<\\|assistant\\|>(.*)",
        turn_dropout=True,
        seed=7,
        num_preprocessing_workers=3,
        output_dir="/out",
        output_format="safetensors",
        start_idx=10,
        layer_ids=[-1, 2, 30],
        num_writer_threads=2,
        fsync=True,
        batch_size=16,
        num_shards=4,
        shard_index=0,
        token_freq_path="freq.pt",
        adopt_existing=True,
        show_progress=True,
    )
    parsed = options_from_args(build_parser().parse_args(shard_arguments(job, 3)))
    assert parsed.engine == job.engine
    assert parsed.preprocessing == job.preprocessing
    want = {**vars(job.output), "shard_index": 3, "show_progress": False}
    assert vars(parsed.output) == want


def test_defaults_stay_defaults_and_verbose_is_passed_on():
    job = DatagenOptions(target_model_path="m", train_data_path="d", output_dir="o", num_shards=2)
    arguments = shard_arguments(job, 1, verbose=True)
    assert "--verbose" in arguments and "--no-progress" in arguments
    parsed = options_from_args(build_parser().parse_args(arguments))
    assert parsed.engine == job.engine and parsed.preprocessing == job.preprocessing
    assert (parsed.output.shard_index, parsed.output.num_shards) == (1, 2)


def test_the_shard_output_is_read_for_its_summary_and_its_one_line_error():
    lines = [
        "INFO something",
        'SUMMARY {"samples_written": 3}',
        error_line("no chat data at x.jsonl"),
    ]
    assert _summary_and_error(lines) == ({"samples_written": 3}, "no chat data at x.jsonl")
    assert _summary_and_error(["SUMMARY {torn"]) == (None, None)


@pytest.mark.parametrize(
    ("returncode", "retryable", "why"),
    [
        (0, False, None),
        (2, False, "bad flag"),
        (1, True, "bad flag"),
        (-signal.SIGKILL, True, "killed by SIGKILL"),
        (None, True, "its Ray task was lost (bad flag)"),
    ],
)
def test_only_a_mistake_in_flags_or_data_is_not_retried(returncode, retryable, why):
    result = AttemptResult(0, 1, returncode, "node", error="bad flag")
    assert result.retryable is retryable
    if why is not None:
        assert result.why() == why


def test_an_attempt_appends_its_output_to_the_shard_log_and_reports_its_error(tmp_path):
    """A real `speculators datagen` process (stopped by its own flag check: no engine)."""
    log = shard_log_path(tmp_path / "out", 1, 2)
    job = DatagenOptions(
        target_model_path=str(tmp_path / "no-model"),
        train_data_path="d.jsonl",
        output_dir=str(tmp_path / "out"),
        num_shards=2,
    )
    for attempt in (1, 2):
        result = run_shard_attempt(1, attempt, shard_arguments(job, 1), str(log), REPO)
        assert (result.returncode, result.retryable) == (2, False)
        assert "no model folder at" in result.error and result.summary is None
    text = log.read_text()
    assert text.count("=== shard 1, attempt 1,") == 1 and text.count("=== shard 1, attempt 2,") == 1
    assert text.count("error: no model folder at") == 2
    assert log == tmp_path / "out" / "logs" / "shard-1-of-2.log"


# Loaded by the shard process (PYTHONPATH): it starts a long-lived child, as a vLLM engine would,
# writes the child's pid and kills itself with SIGKILL, leaving the child behind.
LEAVE_CHILD_HOOK = """
import os, signal, subprocess, sys
_pid_file = os.environ.get("TEST_LEAVE_CHILD")
if _pid_file and "datagen" in sys.argv:
    _child = subprocess.Popen(["sleep", "600"])
    with open(_pid_file, "w") as _out:
        _out.write(str(_child.pid))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_what_a_killed_shard_leaves_running_is_killed_before_the_retry(tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(LEAVE_CHILD_HOOK)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), REPO]))
    monkeypatch.setenv("TEST_LEAVE_CHILD", str(pid_file))
    job = DatagenOptions(target_model_path="m", train_data_path="d", output_dir=str(tmp_path))
    log = shard_log_path(tmp_path, 0, 1)
    result = run_shard_attempt(0, 1, shard_arguments(job, 0), str(log), str(tmp_path))
    child = int(pid_file.read_text())
    try:
        assert (result.returncode, result.retryable) == (-signal.SIGKILL, True)
        assert result.why() == "killed by SIGKILL"
        # SIGKILL lands when the child is next scheduled: wait for that, not for a time.
        deadline = time.monotonic() + 60
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the killed shard's child outlived its attempt"
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)
