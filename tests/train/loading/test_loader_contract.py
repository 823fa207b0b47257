"""The loader contract: what the trainer takes of a loader's optional capabilities, and that every
loader of the package declares the Protocols it satisfies with methods of its own.

A declared Protocol is a base class, so a loader that declared `ReportsProgress` but lost its
`progress_fields` would inherit the Protocol's empty stub and pass `isinstance`: the declaration
test therefore checks that each declared method is the class's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from speculators_vllm016.train import trainer as trainer_module
from speculators_vllm016.train.loading import loader_contract
from speculators_vllm016.train.loading.loader_contract import (
    Closes,
    ReadsAcrossEpochs,
    ReportsProgress,
    ReportsStepMetrics,
    TrainingLoader,
)
from speculators_vllm016.train.loading.sample_loader import SampleFileLoader
from speculators_vllm016.train.online.loader import OnlineLoader
from speculators_vllm016.train.online.remote_loader import RemoteSampleLoader
from speculators_vllm016.train.trainer import Trainer, TrainerConfig
from tests.train.scripted_draft import ScriptedDraft, packed_row

OPTIONAL = (ReadsAcrossEpochs, ReportsProgress, ReportsStepMetrics, Closes)
DECLARED = {
    SampleFileLoader: {TrainingLoader, ReadsAcrossEpochs, Closes},
    OnlineLoader: {TrainingLoader, ReportsProgress},
    RemoteSampleLoader: {TrainingLoader, ReportsProgress, ReportsStepMetrics},
}


def _protocol_methods(protocol: type) -> list[str]:
    return [
        name
        for name, value in vars(protocol).items()
        if (callable(value) and not name.startswith("_")) or name in ("__len__", "__iter__")
    ]


@pytest.mark.parametrize("loader_class", list(DECLARED), ids=lambda cls: cls.__name__)
def test_each_loader_declares_its_protocols_with_its_own_methods(loader_class):
    declared = {base for base in loader_class.__mro__ if base in {TrainingLoader, *OPTIONAL}}
    assert declared == DECLARED[loader_class]
    for protocol in declared:
        for name in _protocol_methods(protocol):
            assert getattr(loader_class, name) is not getattr(protocol, name), (
                f"{loader_class.__name__}.{name} is {protocol.__name__}'s stub"
            )


def test_a_plain_dataloader_is_a_training_loader_without_capabilities():
    """0.3.0's callers hand the trainer a torch DataLoader."""
    loader = DataLoader([packed_row()], batch_size=None)
    assert isinstance(loader, TrainingLoader)
    assert not any(isinstance(loader, capability) for capability in OPTIONAL)


class _Rows(list):
    """A dataset of ready rows that also lists files it could not read."""

    unreadable = [(Path("data_7.pt"), "unreadable"), (Path("data_9.pt"), "not finite")]


class _FiguresLoader(DataLoader):
    """A loader with the two reporting capabilities (as the split online loader has)."""

    def step_metrics(self) -> dict[str, float]:
        return {"online_bytes": 1234.0}

    def progress_fields(self) -> dict[str, str]:
        return {"recv_MB_s": "5.0"}


class _RecordingBar:
    postfixes: list[dict[str, Any]] = []

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def set_postfix(self, **fields: Any) -> None:
        self.postfixes.append(fields)

    def update(self, *_: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_trainer_uses_a_loaders_capabilities(tmp_path, monkeypatch):
    """Step metrics go into every step's record, progress fields onto the bar, and the
    dataset's unreadable files into the run's state."""
    logged: list[dict[str, float]] = []
    monkeypatch.setattr(
        trainer_module, "log_train_step", lambda step, epoch, lr, metrics: logged.append(metrics)
    )
    monkeypatch.setattr(trainer_module, "tqdm", _RecordingBar)
    _RecordingBar.postfixes = []
    config = TrainerConfig(
        lr=1e-3,
        num_epochs=1,
        save_path=str(tmp_path),
        device="cpu",
        show_progress=False,
        handle_sigterm=False,
        scheduler_type="none",
    )
    torch.manual_seed(0)
    loader = _FiguresLoader(_Rows([packed_row(), packed_row()]), batch_size=None)
    state = Trainer(ScriptedDraft(lambda training, call: {}), config, loader).run_training()
    assert [record["online_bytes"] for record in logged] == [1234.0, 1234.0]
    assert [fields.get("recv_MB_s") for fields in _RecordingBar.postfixes] == ["5.0", "5.0"]
    assert state.unreadable_files == 2
    recorded = json.loads((tmp_path / "0" / "training_state.json").read_text())
    assert recorded["unreadable_files"] == 2


def test_unreadable_files_counts_every_loader_and_skips_none():
    with_files = DataLoader(_Rows([packed_row()]), batch_size=None)
    plain = DataLoader([packed_row()], batch_size=None)
    assert loader_contract.unreadable_files(with_files, plain, None, with_files) == 4
