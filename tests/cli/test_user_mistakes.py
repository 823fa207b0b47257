"""User mistakes that ended in a traceback (#37 item 15): each is one line naming the problem,
exit status 2, and nothing written into the user's folders."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.cli.train import main as train_main
from tests.training_fixtures import train_args

CHAT = [
    {
        "conversations": [
            {"from": "human", "value": "Hello there?"},
            {"from": "gpt", "value": "Hello, how can I help?"},
        ]
    }
] * 3


_INFO_RECORD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO ")


def one_line(err: str) -> str:
    """The one error line; progress records logged before the mistake was found (datagen's
    start-up line on whether vLLM can serve the target) are not part of the error."""
    lines = [
        line for line in err.strip().splitlines() if line.strip() and not _INFO_RECORD.match(line)
    ]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def train_error(argv: list[str], capfd) -> str:
    capfd.readouterr()
    assert train_main(argv) == 2
    return one_line(capfd.readouterr().err)


@pytest.fixture
def not_utf8(tmp_path) -> Path:
    """A chat file whose third row holds Latin-1 bytes."""
    path = tmp_path / "latin1.jsonl"
    rows = [json.dumps(row).encode() for row in CHAT[:2]]
    rows.append('{"conversations": [{"from": "human", "value": "caf\u00e9"}]}'.encode("latin-1"))
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def test_train_mistakes_are_one_line_and_leave_the_save_path_alone(
    tiny_llama, training_data, tmp_path, capfd, not_utf8, monkeypatch
):
    save = tmp_path / "save"
    message = train_error(
        train_args(tiny_llama, training_data, save, "--logger", "tensorbord"), capfd
    )
    assert "tensorbord" in message and "--logger" in message
    assert not save.exists()

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    message = train_error(train_args(tiny_llama, training_data, save, "--device", "cuda"), capfd)
    assert "--device cuda" in message and "GPU" in message
    assert not save.exists(), "train_config.yaml or .train.lock left behind"
    monkeypatch.undo()

    chats = tmp_path / "chats"
    chats.mkdir()
    message = train_error(
        train_args(
            tiny_llama,
            training_data,
            save,
            "--online",
            "--train-data-path",
            str(chats),
            "--cache-dir",
            str(tmp_path / "cache"),
        ),
        capfd,
    )
    assert "--train-data-path" in message and "folder" in message
    message = train_error(
        train_args(tiny_llama, training_data, save, "--online", "--train-data-path", str(not_utf8)),
        capfd,
    )
    assert str(not_utf8) in message and "line 3" in message and "UTF-8" in message
    assert not save.exists() and not (tmp_path / "cache").exists()


def test_datagen_names_the_file_and_row_of_text_that_is_not_utf8(tiny_llama, tmp_path, not_utf8):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "datagen",
            "--target-model-path",
            str(tiny_llama),
            "--train-data-path",
            str(not_utf8),
            "--output-dir",
            str(out),
        ],
    )
    assert result.exit_code == 2, result.output
    message = one_line(result.output)
    assert str(not_utf8) in message and "line 3" in message and "UTF-8" in message
    assert not out.exists() or not any(out.iterdir())


def test_eval_refuses_an_unwritable_output_json_before_the_work(
    finished_run, tmp_path, monkeypatch
):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(row) + "\n" for row in CHAT))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    import speculators_vllm016.evaluate.runner as runner

    def no_work(*_, **__):
        raise AssertionError("the evaluation ran before --output-json was checked")

    monkeypatch.setattr(runner, "run_evaluation", no_work)
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(finished_run / "0"),
            "--data-path",
            str(chat),
            "--engine",
            "hf",
            "--output-json",
            str(blocker / "out.json"),
        ],
    )
    assert result.exit_code == 2, result.output
    message = one_line(result.output)
    assert "--output-json" in message and str(blocker) in message


def test_vocab_mapping_refuses_an_unwritable_output_path(training_data, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = CliRunner().invoke(
        app,
        [
            "vocab-mapping",
            "--token-freq-path",
            str(training_data / "token_freq.pt"),
            "--draft-vocab-size",
            "64",
            "--target-vocab-size",
            "512",
            "--output-path",
            str(blocker / "maps"),
        ],
    )
    assert result.exit_code == 2, result.output
    message = one_line(result.output)
    assert "--output-path" in message and str(blocker) in message
