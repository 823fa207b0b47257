"""A folder another command wrote is refused as an output folder (#50 item 4), in one line naming
the flag, exit 2, before anything is written into it: datagen into a regeneration folder,
regenerate into a datagen folder, train's checkpoints into a datagen folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators_vllm016.cli.datagen import main as datagen_main
from speculators_vllm016.cli.regenerate import main as regenerate_main
from speculators_vllm016.data_generation.folder_kinds import MARKERS, folder_kind
from tests.cli.test_user_mistakes import one_line, train_error
from tests.training_fixtures import train_args

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def chat(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return path


def _folder(tmp_path: Path, name: str, marker: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / marker).write_text("{}")
    return folder


def test_datagen_refuses_a_regeneration_folder(tiny_llama, chat, tmp_path, capfd):
    folder = _folder(tmp_path, "regen", "regenerate_job.json")
    before = _files(folder)
    capfd.readouterr()
    argv = ["--target-model-path", str(tiny_llama), "--train-data-path", str(chat)]
    assert datagen_main([*argv, "--output-dir", str(folder), "--max-samples", "1"]) == 2
    line = one_line(capfd.readouterr().err)
    assert f"--output-dir {folder} is a `speculators regenerate` folder" in line, line
    assert _files(folder) == before


def test_regenerate_refuses_a_datagen_folder(tiny_llama, chat, tmp_path, capfd):
    folder = _folder(tmp_path, "data", "data_config.json")
    before = _files(folder)
    capfd.readouterr()
    argv = ["--target-model-path", str(tiny_llama), "--train-data-path", str(chat)]
    assert regenerate_main([*argv, "--output-dir", str(folder), "--max-prompt-tokens", "64"]) == 2
    line = one_line(capfd.readouterr().err)
    assert f"--output-dir {folder} is a `speculators datagen` folder" in line, line
    assert _files(folder) == before


def test_train_refuses_to_save_into_a_datagen_folder(tiny_llama, training_data, tmp_path, capfd):
    folder = _folder(tmp_path, "other_data", "data_config.json")
    before = _files(folder)
    line = train_error(train_args(tiny_llama, training_data, folder, "--epochs", "1"), capfd)
    assert f"--save-path {folder} is a `speculators datagen` folder" in line, line
    assert _files(folder) == before


def test_the_train_file_names_are_trains_own():
    from speculators_vllm016.train.jobs.job_config import CONFIG_FILE
    from speculators_vllm016.train.logger import METRICS_FILE

    assert set(MARKERS["train"]) == {CONFIG_FILE, METRICS_FILE}


def test_a_folder_of_the_same_command_or_of_none_is_nobodys_else(tmp_path):
    assert folder_kind(tmp_path / "missing") is None
    assert folder_kind(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text("")
    assert folder_kind(tmp_path) == ("train", "metrics.jsonl")
