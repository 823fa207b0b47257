"""Fixtures shared by the online-training modules (test_loader.py, test_split.py): one datagen
set-up of the chat rows and one offline two-rank training on it. Each module built both for
itself before, from the same inputs with the same command (the same bytes): a datagen engine
start and a torchrun less per suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.online.test_loader import common, make_setup, train_two_ranks


@pytest.fixture(scope="session")
def setup(tiny_llama, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(root, chat rows, datagen's folder of them), vocabulary maps in root."""
    return make_setup(tiny_llama, tmp_path_factory.mktemp("online"))


@pytest.fixture(scope="session")
def offline_two(setup, tiny_llama) -> Path:
    """Offline training on datagen's folder under torchrun, two ranks (gloo, DDP)."""
    root, _, datagen = setup
    save = root / "offline-2"
    train_two_ranks(
        [*common(tiny_llama, root, save), "--parallel", "ddp", "--data-path", str(datagen)]
    )
    return save
