"""An output place that cannot be created (#50 items 5 and 6): one line naming the flag, exit 2,
before any work. /proc refuses new entries whatever the permission bits say, and root passes
every `os.access` test: the check tries a probe folder instead (made and removed at once)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.cli.regenerate import main as regenerate_main
from speculators_vllm016.utils.output_paths import check_output_file, check_output_folder
from tests.cli.test_user_mistakes import one_line, train_error
from tests.training_fixtures import train_args

UNCREATABLE = Path("/proc/no-such-entry/x")

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")


def test_the_checks_refuse_a_place_that_refuses_new_entries(tmp_path):
    with pytest.raises(ValueError, match=r"^--out /proc/no-such-entry/x is not writable"):
        check_output_folder(UNCREATABLE, "--out")
    with pytest.raises(ValueError, match=r"^--json .*not writable"):
        check_output_file(UNCREATABLE / "ev.json", "--json")
    check_output_folder(tmp_path / "a" / "b", "--out")  # a place that can be created
    assert os.listdir(tmp_path) == []  # the probe is gone, nothing was made


def test_eval_output_json_is_checked_before_the_evaluation(tmp_path):
    base = ["eval", "--draft", str(tmp_path / "no-draft"), "--data-path", "x.jsonl"]
    result = CliRunner().invoke(app, [*base, "--output-json", str(UNCREATABLE / "ev.json")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --output-json "), lines


def test_regenerate_names_its_output_dir(tiny_llama, tmp_path, capfd):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    argv = ["--target-model-path", str(tiny_llama), "--train-data-path", str(data)]
    capfd.readouterr()
    assert regenerate_main([*argv, "--output-dir", str(UNCREATABLE)]) == 2
    assert one_line(capfd.readouterr().err).startswith(f"error: --output-dir {UNCREATABLE} ")


def test_train_names_its_save_path(tiny_llama, training_data, capfd):
    line = train_error(train_args(tiny_llama, training_data, UNCREATABLE), capfd)
    assert line.startswith(f"error: --save-path {UNCREATABLE} "), line


def test_vocab_mapping_names_its_output_path(training_data):
    argv = ["vocab-mapping", "--token-freq-path", str(training_data), "--target-vocab-size", "512"]
    result = CliRunner().invoke(
        app, [*argv, "--output-path", str(UNCREATABLE), "--draft-vocab-size", "8"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith(f"error: --output-path {UNCREATABLE} "), result.output
