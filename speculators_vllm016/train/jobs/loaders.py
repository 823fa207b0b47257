"""A training job's loaders, one builder per data source: sample files, `--online`, and
`--online --extraction-ranks`.

All three read samples through the same `Eagle3SampleFileDataset` and plan rows with the same
sampler (`JobRows`); they differ in where a sample comes from: a file in the data folder, the
extraction engine this process (or rank 0) runs, or the extraction ranks of a split run.
`build_loaders` picks the builder and checks that the training loader makes a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators_vllm016.train.data import (
    Eagle3SampleFileDataset,
    create_collate_fn,
    split_files,
    split_items,
)
from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators_vllm016.train.jobs.job_config import TrainJobConfig, TrainSetupError
from speculators_vllm016.train.jobs.rank_plan import RankPlan
from speculators_vllm016.train.jobs.setup import OnlineSetup, TrainSetup
from speculators_vllm016.train.loading.loader_contract import Closes, TrainingLoader
from speculators_vllm016.train.loading.row_slots import VALIDATION_ROW_SLOTS, HostRowSlots
from speculators_vllm016.train.loading.sample_loader import SampleFileLoader, main_process_noise
from speculators_vllm016.train.noise_transforms import (
    AddGaussianNoise,
    AddUniformNoise,
    TransformTensors,
)
from speculators_vllm016.train.online.errors import CacheFolderError
from speculators_vllm016.train.online.loader import (
    OnlineExtractor,
    OnlineLoader,
    OnlineStats,
    SampleExchange,
)
from speculators_vllm016.train.online.remote_loader import (
    TRAIN_ITERATION,
    VALIDATION_ITERATION,
    RemoteSampleLoader,
)
from speculators_vllm016.train.train_step import collective_device
from speculators_vllm016.train.utils import training_device

__all__ = ["JobLoaders", "JobRows", "build_loaders", "noise_transform"]


@dataclass
class JobLoaders:
    """The job's training and validation loaders (no validation files: None)."""

    train: TrainingLoader
    validation: TrainingLoader | None
    online_stats: OnlineStats | None = None
    """The online extraction's counts (`--online` without extraction ranks), else None."""


@dataclass(frozen=True)
class JobRows:
    """What every loader of the job shares: how sample files become datasets and row plans."""

    config: TrainJobConfig
    standardize: Callable[[dict], dict]
    hidden_size: int
    device: torch.device
    world_size: int
    rank: int

    @property
    def bf16(self) -> bool:
        precision = self.config.runtime.precision
        return precision == "bf16" or (precision == "auto" and self.device.type == "cuda")

    def dataset(
        self,
        files: Sequence[Path],
        transform: TransformTensors | None,
        lengths: list[int] | None = None,
        online: bool = False,
    ) -> Eagle3SampleFileDataset:
        config = self.config
        return Eagle3SampleFileDataset(
            config.training.total_seq_len,
            file_list=[str(file) for file in files],
            transform=transform,
            standardize_fn=self.standardize,
            seed=config.training.seed,
            strict=config.data.strict_data,
            legacy_loss_mask_shift=config.legacy.legacy_loss_mask_shift,
            lengths=lengths,
            output_dtype=torch.bfloat16 if self.bf16 else None,
            # The verifier's widths are the yardstick: not whichever file comes first.
            widths=(3 * self.hidden_size, self.hidden_size),
            # Rows are noised on the training device (the workers only read and pack).
            device_noise=True,
            # fp8 files: dequantized on the device (online rows come dequantized already).
            device_dequantize=not online,
        )

    def sampler(self, dataset: Eagle3SampleFileDataset) -> MultipackDistributedBatchSamplerV2:
        training = self.config.training
        return MultipackDistributedBatchSamplerV2(
            training.total_seq_len, dataset.lengths, self.world_size, self.rank, seed=training.seed
        )

    def main_process_collate(self, dataset: Eagle3SampleFileDataset) -> Any:
        """Rows packed in this process, with the dataset's noise of the current epoch."""
        return main_process_noise(create_collate_fn(self.config.training.total_seq_len), dataset)


def build_loaders(
    config: TrainJobConfig,
    setup: TrainSetup,
    ranks: RankPlan,
    closers: list[Callable[[], Any]],
) -> JobLoaders:
    """The loaders of the job's data source; what the job must close goes into `closers` as soon
    as it is open (an online extractor, then the loaders)."""
    rows = JobRows(
        config,
        setup.standardize,
        int(setup.text_config.hidden_size),
        training_device(ranks.local_rank, ranks.device_name),
        ranks.world_size,
        ranks.rank,
    )
    noise = noise_transform(config)
    if setup.online is None:
        loaders = offline_loaders(rows, setup.data_path, noise)
    else:
        extractor = _open_extractor(config, setup.online, ranks)
        closers.append(extractor.close)
        if ranks.layout is None:
            loaders = online_loaders(rows, extractor, ranks, noise)
        else:
            loaders = split_online_loaders(rows, extractor, ranks, noise)
    for opened in (loaders.train, loaders.validation):  # their workers ignore SIGTERM: end them
        if isinstance(opened, Closes):
            closers.append(opened.close)
    return loaders


def offline_loaders(rows: JobRows, data_path: Path, noise: TransformTensors | None) -> JobLoaders:
    """Sample files in the data folder, read by worker processes (`SampleFileLoader`)."""
    config = rows.config
    runtime = config.runtime
    train_files, val_files = split_files(
        str(data_path), config.data.train_ratio, config.data.split_seed
    )
    workers = runtime.num_workers
    workers = min(12, os.cpu_count() or 1) if workers is None else workers

    def loader(files: list[Path], transform: TransformTensors | None, iteration: int) -> Any:
        dataset = rows.dataset(files, transform)
        # On a GPU the workers pack rows into reused host slots pinned for the copy (#28).
        slots = None
        if rows.device.type == "cuda" and workers > 0 and runtime.row_slots:
            slots = HostRowSlots.for_dataset(
                dataset,
                config.training.total_seq_len,
                workers * runtime.prefetch_factor,
                count=VALIDATION_ROW_SLOTS if iteration == VALIDATION_ITERATION else None,
            )
        return SampleFileLoader(
            dataset,
            batch_sampler=rows.sampler(dataset),
            collate_fn=create_collate_fn(config.training.total_seq_len),
            num_workers=workers,
            prefetch_factor=runtime.prefetch_factor if workers else None,
            pin_memory=rows.device.type == "cuda",
            row_slots=slots,
            # Started once: no worker start-up (and empty prefetch window) at every epoch.
            persistent_workers=workers > 0,
        )

    return _pair(rows, (train_files, val_files), loader, noise)


def online_loaders(
    rows: JobRows, extractor: OnlineExtractor, ranks: RankPlan, noise: TransformTensors | None
) -> JobLoaders:
    """Samples this job's engine extracts (or reads from its cache folder); under torchrun rank
    0 extracts for every rank (`SampleExchange`)."""
    exchange = SampleExchange() if ranks.distributed else None

    def loader(items: list[int], transform: TransformTensors | None, iteration: int) -> Any:
        files = [extractor.sample_path(index) for index in items]
        dataset = rows.dataset(files, transform, extractor.lengths(items), online=True)
        return OnlineLoader(
            extractor,
            dataset,
            items,
            rows.sampler(dataset),
            rows.main_process_collate(dataset),
            rows.config.online.online_queue_size,
            exchange,
        )

    loaders = _pair(rows, _split_indices(rows.config, extractor), loader, noise)
    loaders.online_stats = extractor.stats
    return loaders


def split_online_loaders(
    rows: JobRows, extractor: OnlineExtractor, ranks: RankPlan, noise: TransformTensors | None
) -> JobLoaders:
    """Samples the extraction ranks of a split run send (`RemoteSampleLoader`)."""
    layout, transport = ranks.layout, ranks.transport
    if layout is None or transport is None:
        raise ValueError("split online loaders need a split run's layout and transport")

    def loader(items: list[int], transform: TransformTensors | None, iteration: int) -> Any:
        files = [extractor.sample_path(index) for index in items]
        dataset = rows.dataset(files, transform, extractor.lengths(items), online=True)
        return RemoteSampleLoader(
            layout,
            transport,
            dataset,
            rows.sampler(dataset),
            rows.main_process_collate(dataset),
            iteration,
            rows.config.online.online_queue_size,
            collective_device(rows.device),
        )

    return _pair(rows, _split_indices(rows.config, extractor), loader, noise)


def noise_transform(config: TrainJobConfig) -> TransformTensors | None:
    """The noise added to each training sample's states (--noise-type), or None for none."""
    training = config.training
    if training.noise_type == "none" or training.noise_std == 0:
        return None
    tensors = (
        ("hidden_states", "verifier_last_hidden_states")
        if config.legacy.noise_on_targets
        else ("hidden_states",)
    )
    cls = AddUniformNoise if training.noise_type == "uniform" else AddGaussianNoise
    return cls(std=training.noise_std, tensors=tensors)


def _open_extractor(
    config: TrainJobConfig, online: OnlineSetup, ranks: RankPlan
) -> OnlineExtractor:
    """The online extractor: it lists the samples, and (without extraction ranks) extracts them.
    Only rank 0 of a run without extraction ranks writes the cache folder."""
    cache_dir = config.online.cache_dir
    try:
        return OnlineExtractor(
            online.options,
            online.facts,
            online.dataset,
            Path(cache_dir) if cache_dir else None,
            engine_devices=online.devices.engine_visible if online.devices else None,
            writes_cache=ranks.rank == 0 and ranks.layout is None,
        )
    except CacheFolderError as error:
        raise TrainSetupError(str(error)) from None


def _split_indices(
    config: TrainJobConfig, extractor: OnlineExtractor
) -> tuple[list[int], list[int]]:
    return split_items(extractor.indices, config.data.train_ratio, config.data.split_seed)


def _pair(
    rows: JobRows,
    parts: tuple[list, list],
    loader: Callable[[list, TransformTensors | None, int], Any],
    noise: TransformTensors | None,
) -> JobLoaders:
    """Training (noised) and validation loaders over the two parts of the samples; the training
    one must make a step."""
    train_part, val_part = parts
    train = loader(train_part, noise, TRAIN_ITERATION) if train_part else None
    if train is None or len(train) == 0:
        raise TrainSetupError(
            f"{len(train_part)} training samples make no step for {rows.world_size} "
            "processes; generate more data or use fewer processes"
        )
    validation = loader(val_part, None, VALIDATION_ITERATION) if val_part else None
    return JobLoaders(train, validation)
