"""The round logic of a regeneration run, with a scripted engine (pure logic; the real engine is
tested in test_regenerate_engine.py): order of turns, failures listed, resume, refusals."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from speculators_vllm016.cli.regenerate import main
from speculators_vllm016.data_generation.regeneration.engines import TurnResponse
from speculators_vllm016.data_generation.regeneration.options import (
    RegenerateOptions,
    SamplingOptions,
)
from speculators_vllm016.data_generation.regeneration.run import run_regeneration
from speculators_vllm016.utils.errors import InvalidInputError

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "ORIGINAL one"},
            {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "ORIGINAL two"},
        ]
    },
    {"conversations": [{"from": "human", "value": "alone"}, {"from": "gpt", "value": "ORIGINAL"}]},
    {
        "messages": [
            {"role": "user", "content": "use the tool"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "It is 42"},
        ]
    },
]


class ScriptedEngine:
    """Answers each turn with a name of its own and the prompt it saw (decoded)."""

    def __init__(self, tokenizer, fail_rows_containing: str | None = None):
        self.tokenizer = tokenizer
        self.prompts: list[str] = []
        self.fail = fail_rows_containing

    def respond(self, requests, sampling):
        answers = []
        for request in requests:
            prompt = self.tokenizer.decode(request.prompt_token_ids)
            self.prompts.append(prompt)
            if self.fail and self.fail in prompt:
                answers.append(TurnResponse(None, error="HTTP 503", retryable=True))
            else:
                answers.append(
                    TurnResponse(
                        self.tokenizer.encode(
                            f"ANSWER{len(self.prompts)}", add_special_tokens=False
                        ),
                        finish_reason="length",
                    )
                )
        return answers

    def close(self):
        pass


@pytest.fixture
def tokenizer(tiny_llama: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _options(tiny_llama: Path, tmp_path: Path, **changes) -> RegenerateOptions:
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    fields = {
        "target_model_path": str(tiny_llama),
        "train_data_path": str(data),
        "output_dir": str(tmp_path / "out"),
        "sampling": SamplingOptions(temperature=0.0, max_tokens=8),
        "num_preprocessing_workers": 1,
        "show_progress": False,
    }
    fields.update(changes)
    return RegenerateOptions(**fields)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _error_lines(capsys) -> list[str]:
    """The lines of stderr that report an error (progress bars of the data loader aside)."""
    return [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]


def test_turn_k_is_asked_after_the_regenerated_turns_before_it(tiny_llama, tmp_path, tokenizer):
    engine = ScriptedEngine(tokenizer)
    summary = run_regeneration(_options(tiny_llama, tmp_path), engine=engine)
    rows = _lines(tmp_path / "out" / "conversations.jsonl")
    assert [row["row"] for row in rows] == [0, 1]
    first = rows[0]["messages"]
    # System and user turns kept; each assistant turn replaced.
    assert [m["content"] for m in first] == [
        "Be brief.",
        "first question",
        "ANSWER1",
        "second question",
        "ANSWER3",
    ]
    # Round 0 asked both rows' first turns together; round 1's prompt holds round 0's answer.
    assert "ANSWER1" in engine.prompts[2] and "ORIGINAL" not in engine.prompts[2]
    assert not any("ORIGINAL" in prompt for prompt in engine.prompts)
    failed = _lines(tmp_path / "out" / "failed.jsonl")
    assert failed == [{"row": 2, "reason": "has tool calls"}]
    assert summary.tool_rows == 1 and summary.failed == 1 and summary.regenerated == 2


def test_tool_rows_kept_unchanged(tiny_llama, tmp_path, tokenizer):
    run_regeneration(_options(tiny_llama, tmp_path, tool_rows="keep"), ScriptedEngine(tokenizer))
    rows = _lines(tmp_path / "out" / "conversations.jsonl")
    assert rows[2] == {"row": 2, "messages": ROWS[2]["messages"]}
    assert _lines(tmp_path / "out" / "failed.jsonl") == []


def test_failed_rows_listed_and_server_failures_retried_by_a_rerun(tiny_llama, tmp_path, tokenizer):
    options = _options(tiny_llama, tmp_path, max_prompt_tokens=24)
    summary = run_regeneration(options, ScriptedEngine(tokenizer, fail_rows_containing="alone"))
    failed = {row["row"]: row["reason"] for row in _lines(tmp_path / "out" / "failed.jsonl")}
    assert "over --max-prompt-tokens 24" in failed[0]
    assert failed[1] == "assistant turn 0: HTTP 503"
    assert summary.failed == 3
    # The rerun asks again only for the row the server failed.
    engine = ScriptedEngine(tokenizer)
    summary = run_regeneration(options, engine)
    assert len(engine.prompts) == 1 and "alone" in engine.prompts[0]
    assert [row["row"] for row in _lines(tmp_path / "out" / "conversations.jsonl")] == [1]
    assert summary.regenerated == 1 and summary.already_done == 1


def test_rerun_generates_nothing_and_writes_the_same_bytes(tiny_llama, tmp_path, tokenizer):
    options = _options(tiny_llama, tmp_path)
    run_regeneration(options, ScriptedEngine(tokenizer))
    before = (tmp_path / "out" / "conversations.jsonl").read_bytes()
    # A torn last line (a kill during the append) is skipped, not read as a row.
    log = next((tmp_path / "out" / "rows").glob("*.jsonl"))
    with open(log, "a") as handle:
        handle.write('{"row": 1, "messa')
    engine = ScriptedEngine(tokenizer)
    summary = run_regeneration(options, engine)
    assert engine.prompts == [] and summary.regenerated == 0 and summary.already_done == 2
    assert (tmp_path / "out" / "conversations.jsonl").read_bytes() == before


def test_another_job_in_the_same_folder_is_refused_in_one_line(
    tiny_llama, tmp_path, tokenizer, capsys
):
    options = _options(tiny_llama, tmp_path)
    run_regeneration(options, ScriptedEngine(tokenizer))
    listing = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    code = main(
        [
            "--target-model-path", str(tiny_llama),
            "--train-data-path", options.train_data_path,
            "--output-dir", options.output_dir,
            "--temperature", "0.7",
        ]
    )  # fmt: skip
    error = _error_lines(capsys)
    assert code == 2 and len(error) == 1
    assert "holds another regeneration job" in error[0] and "temperature" in error[0]
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == listing


def test_user_mistakes_are_one_line_before_anything_is_written(tiny_llama, tmp_path, capsys):
    base = ["--target-model-path", str(tiny_llama), "--output-dir", str(tmp_path / "out")]
    for extra, words in (
        (["--train-data-path", str(tmp_path / "missing.jsonl")], "no data file"),
        (["--train-data-path", "x.jsonl", "--chat-template-kwargs", "[1]"], "JSON object"),
        (["--train-data-path", "x.jsonl", "--max-tokens", "0"], "--max-tokens"),
        (["--train-data-path", "x.jsonl", "--endpoint", "localhost:8000"], "--endpoint"),
    ):
        assert main(base + extra) == 2
        error = _error_lines(capsys)
        assert len(error) == 1 and words in error[0], error
    assert not (tmp_path / "out").exists()
    # Found when the engine is about to start (the model's config): the folder is removed again.
    data = _options(tiny_llama, tmp_path).train_data_path
    # (Both given: a default left unset is lowered to fit, see tests/cli/test_regeneration_lengths.)
    too_long = ["--max-prompt-tokens", "1020", "--max-tokens", "2048"]
    assert main([*base, "--train-data-path", data, *too_long]) == 2
    error = _error_lines(capsys)
    assert len(error) == 1 and "longer than the model's 1024" in error[0], error
    assert not (tmp_path / "out").exists()


def test_a_rerun_generates_exactly_the_chunks_the_log_lacks(tiny_llama, tmp_path, tokenizer):
    options = _options(tiny_llama, tmp_path, batch_size=1)
    run_regeneration(options, ScriptedEngine(tokenizer))
    log = next((tmp_path / "out" / "rows").glob("*.jsonl"))
    first_chunk = log.read_text().splitlines()[0]
    log.write_text(first_chunk + "\n")  # killed after the first chunk of one row
    engine = ScriptedEngine(tokenizer)
    summary = run_regeneration(options, engine)
    assert len(engine.prompts) == 1 and "alone" in engine.prompts[0]  # row 1's one turn
    assert summary.regenerated == 1 and summary.already_done == 1


THINKING_TEMPLATE = (
    "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
    "{% if thinking is defined and not thinking %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}"
)


def test_template_kwargs_reach_the_prompt_and_reasoning_is_dropped(tiny_llama, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "thinking_model"
    shutil.copytree(tiny_llama, model)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(model)

    class Thinker(ScriptedEngine):
        def respond(self, requests, sampling):
            for request in requests:
                self.prompts.append(self.tokenizer.decode(request.prompt_token_ids))
            text = "<think>the sea is wide</think>\n\nWaves."
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return [TurnResponse(ids, finish_reason="stop") for _ in requests]

    options = _options(model, tmp_path, chat_template_kwargs={"thinking": False})
    engine = Thinker(tokenizer)
    run_regeneration(options, engine)
    assert all(prompt.endswith("<think></think>") for prompt in engine.prompts)
    kept = _lines(tmp_path / "out" / "conversations.jsonl")[1]["messages"][1]["content"]
    assert kept == "<think>the sea is wide</think>\n\nWaves."
    dropped = tmp_path / "dropped"
    run_regeneration(
        _options(model, tmp_path, output_dir=str(dropped), reasoning="drop"), Thinker(tokenizer)
    )
    assert _lines(dropped / "conversations.jsonl")[1]["messages"][1]["content"] == "Waves."


def test_one_pass_refuses_halves_rendering_with_other_template_arguments(tiny_llama, tmp_path):
    """`datagen --regenerate` must extract the tokens the target answered to: a library caller
    whose two halves disagree on the chat-template arguments is refused before anything."""
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.data_generation.regeneration.one_pass import (
        run_datagen_regenerating,
    )

    regenerate = _options(tiny_llama, tmp_path, chat_template_kwargs={"thinking": False})
    extraction = DatagenOptions(
        target_model_path=str(tiny_llama),
        train_data_path=regenerate.train_data_path,
        output_dir=str(tmp_path / "data"),
        chat_template_kwargs='{"thinking": true}',
    )
    with pytest.raises(InvalidInputError, match="chat template arguments"):
        run_datagen_regenerating(extraction, regenerate)
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()


HOLD_SECONDS = 60  # only a run that fails to give up its chunk waits this long


def _echo_server(tokenizer, stop_on: str, signum: int | None):
    """An OpenAI-style server whose reply depends on the prompt only. With `signum`, a request
    whose prompt holds `stop_on` sends it to this process and is held until the server is shut
    down: a chunk the stop must give up, not wait for. A command that waits for it anyway gets
    its reply after HOLD_SECONDS, and `waited` says so."""
    release, waited = threading.Event(), []

    class Handler(BaseHTTPRequestHandler):
        def _send(self, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            self._send({"data": [{"id": "served"}]})

        def do_POST(self):  # noqa: N802 - http.server's name
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            if signum is not None and stop_on in tokenizer.decode(prompt):
                os.kill(os.getpid(), signum)
                if release.wait(HOLD_SECONDS):
                    return
                waited.append(prompt)
            reply = tokenizer.encode(f"reply to {len(prompt)} tokens", add_special_tokens=False)
            self._send({"choices": [{"token_ids": reply, "finish_reason": "length"}]})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, release, waited


def _endpoint_run(
    tiny_llama, tmp_path, tokenizer, out: Path, signum: int | None = None
) -> tuple[int, list]:
    """The command's exit status, and the held requests it waited for (see `_echo_server`)."""
    server, release, waited = _echo_server(tokenizer, "alone", signum)
    try:
        status = main(
            [
                "--target-model-path", str(tiny_llama),
                "--train-data-path", _options(tiny_llama, tmp_path).train_data_path,
                "--output-dir", str(out), "--endpoint", f"http://127.0.0.1:{server.server_port}",
                "--batch-size", "1", "--request-timeout", str(3 * HOLD_SECONDS), "--retries", "0",
                "--num-preprocessing-workers", "1", "--no-progress",
            ]
        )  # fmt: skip
    finally:
        release.set()
        server.shutdown()
    return status, waited


@pytest.mark.parametrize(
    ("signum", "status", "name"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")]
)
def test_a_stop_signal_gives_up_the_chunk_and_the_same_command_resumes(
    tiny_llama, tmp_path, tokenizer, capsys, signum, status, name
):
    """--endpoint, in process: SIGTERM or Ctrl-C while the second chunk (row 1) waits on the
    server ends the command without waiting for the reply, with one line and its signal's
    status; the first chunk is logged, the second is not; the handlers are the caller's again;
    a rerun equals an uninterrupted run."""
    assert _endpoint_run(tiny_llama, tmp_path, tokenizer, tmp_path / "whole") == (0, [])
    handlers = [signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)]
    capsys.readouterr()
    out = tmp_path / "stopped"
    assert _endpoint_run(tiny_llama, tmp_path, tokenizer, out, signum) == (status, [])
    assert [signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)] == handlers
    log = out / "rows" / "shard-0-of-1.jsonl"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"stopped: {name}: regeneration stopped with 1 of 2 rows of shard 0/1 done, logged in "
        f"{log}; run the same command again to resume"
    )
    assert [line["chunk"] for line in _lines(log)] == [0]
    assert not (out / "conversations.jsonl").exists()
    assert _endpoint_run(tiny_llama, tmp_path, tokenizer, out) == (0, [])
    for file_name in ("conversations.jsonl", "failed.jsonl"):
        assert (out / file_name).read_bytes() == (tmp_path / "whole" / file_name).read_bytes()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (
            {"endpoint": "http://127.0.0.1:9", "tensor_parallel_size": 2},
            "--tensor-parallel-size: in-process engine flags, unused with --endpoint",
        ),
        (
            {"endpoint": "http://127.0.0.1:9", "dtype": "float32", "max_num_seqs": 8},
            "--dtype, --max-num-seqs: in-process engine flags, unused with --endpoint",
        ),
        ({"concurrency": 8}, "--concurrency: flags of --endpoint (a server), unused by the"),
    ],
)
def test_a_flag_of_the_other_engine_is_refused(changes, words):
    """#50 item 14: `--endpoint URL --tensor-parallel-size 2` was accepted and did nothing."""
    options = RegenerateOptions("model", "data.jsonl", "out", **changes)
    with pytest.raises(InvalidInputError, match="^" + re.escape(words)):
        options.validate()
    RegenerateOptions("model", "data.jsonl", "out", endpoint="http://h:1", retries=2).validate()
