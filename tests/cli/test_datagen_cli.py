"""`speculators datagen` refuses bad set-ups at once: one line naming the fix, exit 2, nothing left.

These runs stop before any engine starts, so they are fast.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from speculators_vllm016.cli.datagen import build_parser, main
from speculators_vllm016.demo import demo_conversations_path


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    lines = demo_conversations_path().read_text().splitlines()[:6]
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(capsys, tiny_llama, chats, output: Path, *extra: str, model: str | None = None):
    argv = [
        "--target-model-path",
        model or str(tiny_llama),
        "--train-data-path",
        str(chats),
        "--output-dir",
        str(output),
        "--seq-length",
        "128",
        "--num-preprocessing-workers",
        "1",
        "--hf-cache-dir",
        str(output.parent / "datasets-cache"),
        "--no-progress",
        *extra,
    ]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    return code, lines, err


def assert_refused(code, lines, err, pattern: str, output: Path) -> None:
    assert code == 2, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err
    assert not output.exists(), f"{output} was left behind: {list(output.rglob('*'))}"


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
        (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size must be at least 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["--max-samples", "0"], "--max-samples must be at least 1"),
        (["--max-samples", "-1"], "--max-samples must be at least 1"),
        (["--num-writer-threads", "0"], "--num-writer-threads must be at least 1"),
        (["--layer-ids", "2", "9"], "--layer-ids: layer id 9 is out of range"),
        # The tiny Llama has 4 layers: 4 is one past the last, -5 one before the first.
        (
            ["--layer-ids", "0", "1", "2", "4"],
            "--layer-ids: layer id 4 is out of range .* 4 decoder",
        ),
        (["--layer-ids", "-5", "1"], "--layer-ids: layer id -5 is out of range"),
        (["--assistant-pattern", "(unclosed"], "--assistant-pattern is not a valid regular"),
        (["--transfer-root", "/no/such/folder"], "transfer root /no/such/folder is not a writable"),
        # Regeneration flags are read only with --regenerate, which does not run on Ray.
        (["--temperature", "0"], "--temperature: a regeneration flag, used only with --regen"),
        (["--regenerate-dir", "x"], "--regenerate-dir: a regeneration flag, used only with"),
        (["--chat-template-kwargs", "{thinking"], "--chat-template-kwargs is not JSON"),
        (["--chat-template-kwargs", "true"], "--chat-template-kwargs must be a JSON object"),
        (["--regenerate", "--ray-address", "local"], "--regenerate does not run on Ray"),
    ],
)
def test_bad_flags_are_refused_before_any_work(capsys, tiny_llama, chats, tmp_path, extra, pattern):
    output = tmp_path / "out"
    assert_refused(*run(capsys, tiny_llama, chats, output, *extra), pattern, output)


def test_missing_model_folder_is_named(capsys, tiny_llama, chats, tmp_path):
    output = tmp_path / "out"
    code, lines, err = run(capsys, tiny_llama, chats, output, model=str(tmp_path / "no-such-model"))
    assert_refused(code, lines, err, "no model folder at .*--target-model-path", output)


def test_data_file_problems_are_named(capsys, tiny_llama, tmp_path):
    output = tmp_path / "out"
    missing = tmp_path / "missing.jsonl"
    assert_refused(*run(capsys, tiny_llama, missing, output), "no data file at .*missing", output)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_refused(*run(capsys, tiny_llama, empty, output), "holds no conversations", output)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"conversations": [}')
    assert_refused(
        *run(capsys, tiny_llama, broken, output), "broken.json is not valid JSON", output
    )


def test_output_that_is_a_file_or_read_only_is_refused(capsys, tiny_llama, chats, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    code, lines, err = run(capsys, tiny_llama, chats, a_file)
    assert code == 2 and len(lines) == 1 and "is a file" in lines[0], err[-2000:]
    assert a_file.read_text() == "mine"
    if os.geteuid() == 0:
        return  # root writes anywhere
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, lines, err = run(capsys, tiny_llama, chats, locked / "out")
    assert code == 2 and len(lines) == 1 and "writable" in lines[0], err[-2000:]


def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.option_strings == ["-h", "--help"]:
            continue
        assert action.help, f"{action.option_strings} has no help"
    text = " ".join(parser.format_help().split())
    assert "0.3.0 used every visible GPU, now 1" in text
    assert "(default: 1)" in text
    assert "--trust-remote-code" in text and "--adopt-existing" in text


REMOTE_CONFIG = """
from pathlib import Path
from transformers import LlamaConfig

Path(MARKER).write_text("yes")


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom_llama"
"""


def test_model_code_runs_only_when_asked(capsys, tiny_llama, chats, tmp_path):
    import shutil

    model = tmp_path / "custom-model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "tiny_custom_llama"
    config["auto_map"] = {"AutoConfig": "configuration_custom.TinyCustomConfig"}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "CODE_RAN"
    (model / "configuration_custom.py").write_text(
        REMOTE_CONFIG.replace("MARKER", repr(str(marker)))
    )
    output = tmp_path / "out"
    code, lines, err = run(capsys, tiny_llama, chats, output, model=str(model))
    assert_refused(code, lines, err, "needs the Python code .*pass --trust-remote-code", output)
    assert not marker.exists(), "the model folder's code ran"
    assert "Tokenizing" not in err, "refused only after preprocessing"


def test_generator_does_not_trust_remote_code_by_default():
    import inspect

    from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator,
    )

    default = inspect.signature(VllmHiddenStatesGenerator).parameters["trust_remote_code"].default
    assert default is False


def test_a_run_that_fails_to_start_records_no_identity(capsys, tiny_llama, chats, tmp_path):
    """A flag only vLLM can judge fails at engine start: the folder must still accept the fix."""
    output = tmp_path / "out"
    output.mkdir()
    code, lines, err = run(capsys, tiny_llama, chats, output, "--max-num-batched-tokens", "10")
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert not (output / ".datagen_state.json").exists()
    assert not [p for p in output.iterdir() if p.name.startswith("data_")]


def test_every_demo_flag_has_help():
    from speculators_vllm016.demo.cli import build_parser as demo_parser

    for action in demo_parser()._actions:
        if action.option_strings and action.option_strings != ["-h", "--help"]:
            assert action.help, f"demo {action.option_strings} has no help"


def test_vllms_start_up_lines_are_kept_out_of_the_way_unless_verbose(tmp_path, monkeypatch):
    """#37 item 22: by the time the engine would start, vLLM's logging level is WARNING (its
    variable for the import and the workers, and its logger if already imported); --verbose
    leaves vLLM as it is, and a level the user set is kept."""
    import logging

    from speculators_vllm016.cli import datagen as cli
    from speculators_vllm016.data_generation import offline
    from speculators_vllm016.utils.errors import InvalidInputError

    seen = []

    def fake_run(options):
        seen.append((os.environ.get("VLLM_LOGGING_LEVEL"), logging.getLogger("vllm").level))
        raise InvalidInputError("stopped before the engine")  # an expected failure: one line

    monkeypatch.setattr(offline, "run_datagen", fake_run)
    argv = [
        "--target-model-path",
        str(tmp_path),
        "--train-data-path",
        "x.jsonl",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    for extra, preset in (([], None), (["--verbose"], None), ([], "DEBUG")):
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
        if preset:
            monkeypatch.setenv("VLLM_LOGGING_LEVEL", preset)
        logging.getLogger("vllm").setLevel(logging.NOTSET)
        assert cli.main([*argv, *extra]) == 2
    assert seen == [("WARNING", logging.WARNING), (None, logging.NOTSET), ("DEBUG", logging.DEBUG)]
