"""#37 item 21: one wording per mistake across commands, and every command's error line ends
the same way (`utils.command_errors.error_line`). Typical mistakes of each command, in process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.utils.command_errors import DEBUG_HINT

TOO_LARGE = "--draft-vocab-size 600 is larger than the target's vocabulary of 512 tokens; choose at most 512"


@pytest.fixture(autouse=True)
def _fresh_root_logging():
    """Each command runs as in a fresh process: a handler that an earlier in-process command
    put on the root logger (eval's `basicConfig`) would print its INFO records here too."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _error_line(argv: list[str]) -> str:
    """The command's stderr: exactly one line, and exit status 2."""
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, (argv, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, (argv, result.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama):
    from tests.evaluate.drafts import build_draft

    root = tmp_path_factory.mktemp("mistakes")
    counts = root / "token_freq.pt"
    import torch

    torch.save({1: 5, 2: 3}, counts)
    (root / "chat.jsonl").write_text(
        json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "Hi?"},
                    {"from": "gpt", "value": "Hello."},
                ]
            }
        )
        + "\n"
    )
    build_draft(str(tiny_llama), seed=0).save_pretrained(root / "draft")
    (root / "a-file").write_text("")
    return root


def test_a_draft_vocabulary_larger_than_the_targets_has_one_wording(files, tiny_llama, tmp_path):
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    lines = [
        _error_line(
            [
                "vocab-mapping",
                "--token-freq-path",
                str(files / "token_freq.pt"),
                "--draft-vocab-size",
                "600",
                "--target-vocab-size",
                "512",
                "--output-path",
                str(tmp_path / "maps"),
            ]
        ),
        _error_line(
            [
                "gen-and-train",
                "--target-model-path",
                str(tiny_llama),
                "--train-data-path",
                str(files / "chat.jsonl"),
                "--output-dir",
                str(tmp_path / "run"),
                "--draft-vocab-size",
                "600",
                "--target-vocab-size",
                "512",
            ]
        ),
        _error_line(
            [
                "gen-and-train",
                "--target-model-path",
                str(tiny_llama),
                "--train-data-path",
                str(files / "chat.jsonl"),
                "--output-dir",
                str(tmp_path / "run"),
                "--draft-vocab-size",
                "600",
            ]
        ),
    ]
    assert lines == [f"error: {TOO_LARGE} {DEBUG_HINT}"] * 3, lines
    with pytest.raises(ValueError) as raised:  # the library function says it the same way
        build_vocab_mappings_from_distribution({1: 1}, 600, 512)
    assert str(raised.value) == TOO_LARGE
    assert not (tmp_path / "maps").exists() and not (tmp_path / "run").exists()


def test_eval_names_its_own_data_flag(files):
    line = _error_line(
        [
            "eval",
            "--draft",
            str(files / "draft"),
            "--data-path",
            str(files / "missing.jsonl"),
            "--engine",
            "hf",
        ]
    )
    assert "--data-path" in line and "--train-data-path" not in line, line


def test_every_command_ends_its_error_line_the_same_way(files, tmp_path):
    mistakes = {
        "train": ["train", "--config", str(tmp_path / "missing.yaml")],
        "datagen": [
            "datagen",
            "--target-model-path",
            str(tmp_path / "no-model"),
            "--train-data-path",
            str(files / "chat.jsonl"),
            "--output-dir",
            str(tmp_path / "data"),
        ],
        "regenerate": [
            "regenerate",
            "--target-model-path",
            str(tmp_path / "no-model"),
            "--train-data-path",
            str(files / "chat.jsonl"),
            "--output-dir",
            str(tmp_path / "regenerated"),
        ],
        "eval": [
            "eval",
            "--draft",
            str(tmp_path / "no-draft"),
            "--data-path",
            str(files / "chat.jsonl"),
        ],
        "convert": [
            "convert",
            str(tmp_path / "no-checkpoint"),
            "--algorithm",
            "eagle3",
            "--verifier",
            str(tmp_path / "no-verifier"),
            "--output-path",
            str(tmp_path / "out"),
        ],
        "vocab-mapping": [
            "vocab-mapping",
            "--token-freq-path",
            str(tmp_path / "none.pt"),
            "--draft-vocab-size",
            "8",
            "--output-path",
            str(tmp_path / "maps"),
        ],
        "gen-and-train": ["gen-and-train", "--target-model-path", str(tmp_path / "no-model")],
        "demo": ["demo", "--output-dir", str(files / "a-file" / "demo"), "--no-progress"],
    }
    for command, argv in mistakes.items():
        line = _error_line(argv)
        assert line.startswith("error: ") and line.endswith(f" {DEBUG_HINT}"), (command, line)
