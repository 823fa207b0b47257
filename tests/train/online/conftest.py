"""Fixtures shared by the online-training modules (test_loader.py, test_split.py): one datagen
set-up of the chat rows and one offline two-rank training on it. Each module built both for
itself before, from the same inputs with the same command (the same bytes): a datagen engine
start and a torchrun less per suite."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.train.online.test_loader import common, make_setup
from tests.training_fixtures import cli_env, train_command


@pytest.fixture(scope="session")
def setup(tiny_llama, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(root, chat rows, datagen's folder of them), vocabulary maps in root."""
    return make_setup(tiny_llama, tmp_path_factory.mktemp("online"))


@pytest.fixture(scope="session")
def offline_two(setup, tiny_llama) -> Path:
    """Offline training on datagen's folder under torchrun, two ranks (gloo, DDP)."""
    root, _, datagen = setup
    save = root / "offline-2"
    argv = [*common(tiny_llama, root, save), "--parallel", "ddp", "--data-path", str(datagen)]
    done = subprocess.run(
        train_command(argv, processes=2),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return save
