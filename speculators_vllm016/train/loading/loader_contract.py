"""What the trainer asks of a loader: one required Protocol and the optional capabilities.

Every loader the trainer is handed satisfies `TrainingLoader` (a torch `DataLoader` does: 0.3.0's
`Trainer(model, config, train_loader, val_loader)` takes one). The other Protocols are
capabilities a loader may add; the trainer asks for each with `isinstance`, so a loader that
lacks one is trained on all the same. The loaders of this package declare what they satisfy:
`SampleFileLoader` (offline files), `OnlineLoader` (`--online`), `RemoteSampleLoader`
(`--extraction-ranks`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Closes",
    "ListsUnreadableFiles",
    "ReadsAcrossEpochs",
    "ReportsProgress",
    "ReportsStepMetrics",
    "SetsEpoch",
    "TrainingLoader",
    "unreadable_files",
]


@runtime_checkable
class TrainingLoader(Protocol):
    """Required: the packed rows of one epoch, and how many there are (the epoch's steps)."""

    batch_sampler: Any
    """The plan of the epoch's rows; given the epoch (and a start step) when it `SetsEpoch`."""
    dataset: Any
    """The samples; told the epoch when it `SetsEpoch`, read for `ListsUnreadableFiles`."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


@runtime_checkable
class ReadsAcrossEpochs(Protocol):
    """Optional: reads ahead across epoch boundaries (the trainer then never calls `iter`)."""

    def epoch_rows(
        self, epoch: int, start_step: int = 0, *, last_epoch: int | None = None
    ) -> Iterator[Any]: ...


@runtime_checkable
class ReportsProgress(Protocol):
    """Optional: fields the progress bar shows beside the loss (online: the extraction's side)."""

    def progress_fields(self) -> dict[str, str]: ...


@runtime_checkable
class ReportsStepMetrics(Protocol):
    """Optional: figures logged with every step's metrics (split online: the bytes moved)."""

    def step_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class Closes(Protocol):
    """Optional: resources (worker processes, pinned slots) the job ends when it ends."""

    def close(self) -> None: ...


@runtime_checkable
class SetsEpoch(Protocol):
    """Optional, of a loader's sampler or dataset: told each epoch (its shuffle, its noise)."""

    def set_epoch(self, epoch: int, *args: Any) -> None: ...


@runtime_checkable
class ListsUnreadableFiles(Protocol):
    """Optional, of a loader's dataset: the sample files it left out when listing the data."""

    unreadable: Sized


def unreadable_files(*loaders: TrainingLoader | None) -> int:
    """How many sample files the loaders' datasets left out (each named in the log)."""
    datasets = [loader.dataset for loader in loaders if loader is not None]
    return sum(len(data.unreadable) for data in datasets if isinstance(data, ListsUnreadableFiles))
