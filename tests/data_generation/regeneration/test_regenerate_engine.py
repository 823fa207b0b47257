"""Regeneration on the real vLLM 0.16 CPU engine (tiny Llama, fp32), checked against transformers.

One in-process engine serves every test of the module, the reruns of stopped commands included;
the kill -9 and SIGTERM tests run the command in a subprocess, and the endpoint test starts
vLLM's OpenAI server once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.regeneration.options import (
    RegenerateOptions,
    SamplingOptions,
)
from speculators_vllm016.data_generation.regeneration.run import run_regeneration

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
MAX_PROMPT_TOKENS = 192
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Numbers 0 1 2 3",
    "The quick brown fox",
    "Hidden states teach the draft.",
    "What comes next?",
]


def _rows(count: int) -> list[dict]:
    rows = []
    for index in range(count):
        first, second = QUESTIONS[index % 6], QUESTIONS[(index + 2) % 6]
        turns = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": "a shipped answer"},
        ]
        if index % 2 == 0:  # every other row has a second exchange
            turns += [
                {"role": "user", "content": second},
                {"role": "assistant", "content": "another shipped answer"},
            ]
        if index % 3 == 0:
            turns.insert(0, {"role": "system", "content": "Answer briefly."})
        rows.append({"messages": turns})
    return rows


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen_data") / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rows(24)))
    return path


def _options(model: Path, data: Path, out: Path, **changes) -> RegenerateOptions:
    fields = {
        "target_model_path": str(model),
        "train_data_path": str(data),
        "output_dir": str(out),
        "sampling": SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS),
        "max_prompt_tokens": MAX_PROMPT_TOKENS,
        "dtype": "float32",
        "num_preprocessing_workers": 1,
        "show_progress": False,
    }
    fields.update(changes)
    return RegenerateOptions(**fields)


@pytest.fixture(scope="module")
def local_engine(tiny_llama: Path, chat_data: Path):
    from speculators_vllm016.data_generation.regeneration.local_engine import LocalEngine

    engine = LocalEngine(_options(tiny_llama, chat_data, Path("unused")))
    yield engine
    engine.close()


def _messages(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]


def _transformers_turns(model_path: Path, rows: list[dict]) -> list[list[dict]]:
    """Greedy generation by transformers (fp32), turn after turn, as regeneration must do it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    eos = [tokenizer.eos_token_id]
    regenerated = []
    for row in rows:
        messages = [dict(turn) for turn in row["messages"]]
        for position, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            text = tokenizer.apply_chat_template(
                messages[:position], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = out[0, len(ids) :].tolist()
            if new and new[-1] in eos:
                new = new[:-1]  # the end-of-turn token is not part of the turn
            turn["content"] = tokenizer.decode(new, skip_special_tokens=False)
        regenerated.append(messages)
    return regenerated


def test_greedy_turns_equal_transformers_greedy_generation(
    tiny_llama, chat_data, local_engine, tmp_path
):
    rows = _rows(24)[:6]
    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_regeneration(_options(tiny_llama, data, tmp_path / "out"), engine=local_engine)
    got = [row["messages"] for row in _messages(tmp_path / "out")]
    assert got == _transformers_turns(tiny_llama, rows)
    assert all("shipped" not in turn["content"] for row in got for turn in row)


def test_seeded_sampling_is_reproducible_and_follows_the_seed(
    tiny_llama, chat_data, local_engine, tmp_path
):
    outputs = []
    for seed in (3, 3, 4):
        out = tmp_path / f"run{len(outputs)}"
        sampling = SamplingOptions(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=seed)
        run_regeneration(_options(tiny_llama, chat_data, out, sampling=sampling), local_engine)
        outputs.append((out / "conversations.jsonl").read_bytes())
    assert outputs[0] == outputs[1]
    assert outputs[2] != outputs[0]


def _command(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "speculators_vllm016", "regenerate",
        "--target-model-path", str(model), "--train-data-path", str(data),
        "--output-dir", str(out), "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
        "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--dtype", "float32",
        "--num-preprocessing-workers", "1", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def whole_in_chunks_of_2(tiny_llama, chat_data, local_engine, tmp_path_factory) -> Path:
    """An uninterrupted run in chunks of 2 rows: what an interrupted one must end with."""
    whole = tmp_path_factory.mktemp("regen_whole")
    run_regeneration(_options(tiny_llama, chat_data, whole, batch_size=2), engine=local_engine)
    return whole


def _wait_for_logged_chunks(process: subprocess.Popen, log: Path, chunks: int) -> None:
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline and process.poll() is None:
        if log.exists() and log.read_text().count("\n") >= chunks:
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_then_rerun_equals_an_uninterrupted_run(
    tiny_llama, chat_data, local_engine, whole_in_chunks_of_2, tmp_path
):
    """The command killed (SIGKILL, its engine too) after 2 chunks; the same job run again (on
    the module's engine: the resume reads what the killed process left, whoever runs it)
    finishes it, and the result equals an uninterrupted run byte for byte."""
    whole = whole_in_chunks_of_2
    out = tmp_path / "killed"
    log = out / "rows" / "shard-0-of-1.jsonl"
    command = _command(tiny_llama, chat_data, out, "--batch-size", "2")
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        _wait_for_logged_chunks(process, log, 2)
        assert process.poll() is None, "the run ended before it could be killed"
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    logged = log.read_text().count("\n")  # chunks of 2 rows
    assert 2 <= logged < 12 and not (out / "conversations.jsonl").exists()
    summary = run_regeneration(
        _options(tiny_llama, chat_data, out, batch_size=2), engine=local_engine
    )
    assert summary.already_done >= 2 * logged and summary.regenerated <= 24 - 2 * logged
    assert (out / "conversations.jsonl").read_bytes() == (
        whole / "conversations.jsonl"
    ).read_bytes()


def _processes_in_group(group: int) -> list[str]:
    """The live processes of a process group: pid and command line. Zombies and processes with
    no command line left (their memory already released: they are in the middle of exiting) are
    not counted."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        state, _parent, pgid = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgid) == group and state != "Z" and command:
            found.append(f"{entry.name} {command}")
    return found


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_cleanly_and_a_rerun_completes_it(
    tiny_llama, chat_data, local_engine, whole_in_chunks_of_2, tmp_path
):
    """A scheduler's SIGTERM to the command's process group (its engine core included) once a
    chunk is logged: exit 143 with one `stopped:` line, only whole chunks in the log, no process
    of the run left; the same job resumed equals an uninterrupted run."""
    out = tmp_path / "stopped"
    log = out / "rows" / "shard-0-of-1.jsonl"
    command = _command(tiny_llama, chat_data, out, "--batch-size", "2")
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_logged_chunks(process, log, 1)
        assert process.poll() is None, "the run ended before it could be stopped"
        os.killpg(process.pid, signal.SIGTERM)
        stderr = process.communicate(timeout=300)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGTERM: regeneration stopped with "), stderr[-3000:]
    assert last.endswith(f"logged in {log}; run the same command again to resume"), last
    assert _processes_in_group(process.pid) == []
    chunks = [json.loads(line) for line in log.read_text().splitlines()]  # each line whole
    assert 1 <= len(chunks) < 12 and f"with {2 * len(chunks)} of 24 rows" in last
    assert not (out / "conversations.jsonl").exists()
    summary = run_regeneration(
        _options(tiny_llama, chat_data, out, batch_size=2), engine=local_engine
    )
    assert summary.already_done == 2 * len(chunks)
    assert (out / "conversations.jsonl").read_bytes() == (
        whole_in_chunks_of_2 / "conversations.jsonl"
    ).read_bytes()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_llama: Path):
    """`vllm serve` (vLLM's OpenAI API server) on the tiny Llama, started once."""
    import httpx

    port = _free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
        "--dtype", "float32", "--max-model-len", str(MAX_PROMPT_TOKENS + MAX_TOKENS),
        "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "tiny",
    ]  # fmt: skip
    server = subprocess.Popen(
        command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, "the vLLM server exited"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_endpoint_output_equals_in_process_output(
    tiny_llama, chat_data, local_engine, vllm_server, tmp_path, temperature
):
    sampling = SamplingOptions(temperature=temperature, max_tokens=MAX_TOKENS, seed=11)
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_regeneration(_options(tiny_llama, chat_data, local, sampling=sampling), local_engine)
    options = _options(  # dtype: the server's own (an engine flag is refused with --endpoint)
        tiny_llama, chat_data, remote, sampling=sampling, endpoint=vllm_server, concurrency=8
    )
    options.dtype = "auto"
    run_regeneration(options)
    assert (remote / "conversations.jsonl").read_bytes() == (
        local / "conversations.jsonl"
    ).read_bytes()
    assert (remote / "failed.jsonl").read_text() == ""


def _datagen_files(folder: Path) -> dict[str, object]:
    """The sample files, token counts and manifest of a datagen folder, by relative path.

    The manifest's lines are compared as a set: writer threads append them as files finish.
    """
    files: dict[str, object] = {
        str(path.relative_to(folder)): path.read_bytes()
        for pattern in ("data_*.pt", "token_freq/*")
        for path in sorted(folder.glob(pattern))
    }
    for path in sorted(folder.glob("manifest/*")):
        files[str(path.relative_to(folder))] = sorted(path.read_text().splitlines())
    return files


# `datagen --regenerate` whose regeneration sends SIGTERM to its process group (its engine's
# workers included) as the second chunk's first round starts.
STOPPING_DATAGEN = """
import os, signal, sys
from speculators_vllm016.cli.datagen import main
from speculators_vllm016.data_generation.regeneration.capture_engine import GeneratorEngine
respond, calls = GeneratorEngine.respond, []
def respond_then_stop(self, requests, sampling):
    calls.append(1)
    if len(calls) == 3:
        os.killpg(0, signal.SIGTERM)
    return respond(self, requests, sampling)
GeneratorEngine.respond = respond_then_stop
sys.exit(main(sys.argv[1:]))
"""


def _stopped_by_sigterm_in_its_second_chunk(argv: list[str], regenerated: Path) -> None:
    """The one-pass command stops with 143 and one line, the first chunk (3 rows) logged and
    nothing extracted, no process of the run left."""
    process = subprocess.Popen(
        [sys.executable, "-c", STOPPING_DATAGEN, *argv],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stderr = process.communicate(timeout=600)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 143, stderr[-3000:]
    log = regenerated / "rows" / "shard-0-of-1.jsonl"
    assert stderr.strip().splitlines()[-1] == (
        "stopped: SIGTERM: regeneration stopped with 3 of 8 rows of shard 0/1 done, logged in "
        f"{log}; run the same command again to resume"
    )
    assert [json.loads(line)["chunk"] for line in log.read_text().splitlines()] == [0]
    assert not list(regenerated.parent.glob("data_*.pt"))
    assert _processes_in_group(process.pid) == []


@pytest.mark.slow
def test_datagen_regenerate_in_one_pass_equals_regenerate_then_datagen(
    tiny_llama, local_engine, tmp_path
):
    from speculators_vllm016.cli.datagen import main as datagen

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _rows(8)))
    common = [
        "--target-model-path", str(tiny_llama), "--seq-length", "256", "--dtype", "float32",
        "--num-preprocessing-workers", "1", "--batch-size", "3", "--no-progress",
    ]  # fmt: skip
    # Two passes: `speculators regenerate` (vLLM's LLM), then plain datagen on its output.
    run_regeneration(_options(tiny_llama, data, tmp_path / "regen"), engine=local_engine)
    regenerated = tmp_path / "regen" / "conversations.jsonl"
    two = tmp_path / "two_pass"
    assert datagen([*common, "--train-data-path", str(regenerated), "--output-dir", str(two)]) == 0
    # One pass: one engine answers the turns, then extracts.
    one = tmp_path / "one_pass"
    regeneration = [
        "--regenerate", "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
        "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
    ]  # fmt: skip
    argv = [*common, "--train-data-path", str(data), "--output-dir", str(one), *regeneration]
    _stopped_by_sigterm_in_its_second_chunk(argv, one / "regenerated")
    assert datagen(argv) == 0  # resumes
    assert (one / "regenerated" / "conversations.jsonl").read_bytes() == regenerated.read_bytes()
    files = _datagen_files(two)
    assert len([name for name in files if name.startswith("data_")]) == 8
    assert _datagen_files(one) == files
    # Run again: nothing is regenerated or extracted twice, the files stay.
    assert datagen(argv) == 0
    assert _datagen_files(one) == files
