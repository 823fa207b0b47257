"""One training job from its config: prepare -> build the draft and the loaders -> train -> close.

The library entry point of `speculators train` (which only parses the command line into a
`TrainJobConfig`), of `gen-and-train` and of the demo. One process trains on one device; under
torchrun every process runs this with the same config (data-parallel, FSDP2 or DDP).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.job_config import (
    CHECKPOINT_DTYPES,
    CONFIG_FILE,
    TrainJobConfig,
    TrainSetupError,
    save_job_config,
)
from speculators_vllm016.train.jobs.setup import TrainSetup, build_model, noise_transform, prepare
from speculators_vllm016.utils.eagle3_serving import target_serving_line

if TYPE_CHECKING:
    from speculators_vllm016.train.checkpointer import TrainingState
    from speculators_vllm016.train.online.loader import OnlineStats

__all__ = ["TrainJobResult", "run_train_job"]

logger = logging.getLogger("speculators")


@dataclass
class TrainJobResult:
    """What a finished job did (every rank returns one; rank 0 reports it)."""

    state: TrainingState
    save_path: Path
    rank: int
    online: OnlineStats | None = None
    """The online extraction's counts (`--online`), else None."""
    received_bytes: int | None = None
    """With --extraction-ranks: the hidden states this training rank received, in bytes."""
    already_complete: bool = False
    """The save path held a finished run (its last epoch or --max-steps): nothing was trained."""

    def describe(self) -> str:
        skipped = "".join(f", {phrase}" for phrase in self.data_losses())
        if self.online is not None:
            stats = self.online
            skipped += (
                f"; online: {stats.extracted_samples} samples extracted, "
                f"{stats.cached_reads} read from the cache, engine started "
                f"{stats.engine_starts} times"
            )
        if self.received_bytes is not None:
            skipped += f"; online: {self.received_bytes / 1e6:,.1f} MB of samples received from the extraction ranks"
        if self.already_complete:
            return (
                f"Already complete: {self.state.global_step} steps, checkpoints in "
                f"{self.save_path}; nothing was trained (to train more, raise --epochs, or "
                "--max-steps if it was set, and run the same command)"
            )
        return f"Done: {self.state.global_step} steps{self.outcome()}, checkpoints in {self.save_path}{skipped}"

    def outcome(self) -> str:
        """ ", last loss L, validation tau_sim T, best checkpoint P (tau_sim B)" as far as known."""
        state, parts = self.state, []
        if state.last_loss is not None:
            parts.append(f"last loss {state.last_loss:.4f}")
        if state.val_tau_sim is not None:
            parts.append(f"validation tau_sim {state.val_tau_sim:.3f}")
        if state.best_checkpoint is not None and state.best_val_tau_sim is not None:
            parts.append(
                f"best checkpoint {self.save_path / state.best_checkpoint} "
                f"(tau_sim {state.best_val_tau_sim:.3f})"
            )
        return "".join(f", {part}" for part in parts)

    def data_losses(self) -> list[str]:
        """The samples the run could not use, counted ("1 unusable sample skipped", ...)."""
        phrases = []
        if self.state.skipped_samples:
            count = self.state.skipped_samples
            phrases.append(f"{count} unusable sample{'s' if count != 1 else ''} skipped")
        if self.state.unreadable_files:
            count = self.state.unreadable_files
            phrases.append(f"{count} unreadable sample file{'s' if count != 1 else ''} left out")
        return phrases


def run_train_job(
    config: TrainJobConfig,
    setup: TrainSetup | None = None,
    report: Callable[[TrainJobResult], None] | None = None,
) -> TrainJobResult | None:
    """Train the draft `config` describes; `setup`: `prepare(config)`'s result, if already made.

    `report` is called on rank 0 once training finished, before the online engine and the
    process group close: what was trained is reported even when closing then fails. An
    extraction rank of `--extraction-ranks` trains nothing and returns None."""
    import torch

    from speculators_vllm016.train.data import (
        Eagle3SampleFileDataset,
        create_collate_fn,
        split_files,
        split_items,
    )
    from speculators_vllm016.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )
    from speculators_vllm016.train.loading.row_slots import VALIDATION_ROW_SLOTS, HostRowSlots
    from speculators_vllm016.train.loading.sample_loader import SampleFileLoader, main_process_noise
    from speculators_vllm016.train.logger import (
        METRICS_FILE,
        setup_metric_logger,
        setup_root_logger,
    )
    from speculators_vllm016.train.online.remote_loader import (
        TRAIN_ITERATION,
        VALIDATION_ITERATION,
        RemoteSampleLoader,
        finish_extraction,
    )
    from speculators_vllm016.train.online.split import run_extraction_rank, split_layout
    from speculators_vllm016.train.train_step import collective_device
    from speculators_vllm016.train.trainer import Trainer
    from speculators_vllm016.train.utils import (
        maybe_destroy_distributed,
        maybe_setup_distributed,
        training_device,
    )
    from speculators_vllm016.train.vocab_maps import save_vocab_maps

    setup = prepare(config) if setup is None else setup
    data_path, save_path, vocab = setup.data_path, setup.save_path, setup.vocab
    standardize, online = setup.standardize, setup.online
    data, training, runtime, log = config.data, config.training, config.runtime, config.logging

    # -- the run ---------------------------------------------------------------------------------
    device_name = runtime.device
    if online is not None and online.devices is not None:
        device_name = online.devices.for_rank(int(os.environ.get("LOCAL_RANK", "0")))
    closers: list[Callable[[], Any]] = []
    layout = split_layout(config)  # --extraction-ranks: this rank extracts or trains, not both
    if layout is not None:
        from speculators_vllm016.train.online.split_groups import join_split_groups

        groups = join_split_groups(layout)
        if layout.extracts:
            setup_root_logger("INFO", ranks="every")
            run_extraction_rank(config, setup, layout, groups)
            return None
        transport = groups.transport()
        closers.append(lambda: finish_extraction(layout, transport))
        stopped_exit = _StoppedExit.install()
        device_name = layout.training_device
        local_rank, world_size = int(os.environ.get("LOCAL_RANK", "0")), layout.training_world_size
        rank, distributed = layout.training_rank, True
    else:
        local_rank, world_size, rank, distributed = maybe_setup_distributed(device_name)
    failure: BaseException | None = None
    try:
        setup_root_logger(
            "INFO",
            ranks="local-0" if layout is None else "rank-0",
            train_steps=config.logging.no_progress,
        )  # a bar shows them otherwise
        save_path.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            save_job_config(config, save_path / CONFIG_FILE)
            logger.info(
                target_serving_line(
                    getattr(setup.verifier_config, "architectures", None) or [],
                    str(getattr(setup.text_config, "model_type", "")),
                )
            )
        if rank == 0 and vocab.built_from:
            save_vocab_maps(vocab, save_path)
            logger.info(
                "vocabulary maps built from %s -> %s/{d2t,t2d}.npy", vocab.built_from, save_path
            )
        setup_metric_logger(
            log.logger, log.run_name, log.log_dir, jsonl_path=save_path / METRICS_FILE
        )
        model = build_model(config, setup)
        hidden_size = int(setup.text_config.hidden_size)

        workers = (
            runtime.num_workers if runtime.num_workers is not None else min(12, os.cpu_count() or 1)
        )
        device = training_device(local_rank, device_name)
        bf16 = runtime.precision == "bf16" or (
            runtime.precision == "auto" and device.type == "cuda"
        )
        extractor = None
        if online is not None:
            from speculators_vllm016.train.online.loader import (
                CacheFolderError,
                OnlineExtractor,
                OnlineLoader,
                SampleExchange,
            )

            # Rank 0 extracts for all (without --extraction-ranks; with it, extraction ranks do).
            exchange = SampleExchange() if distributed and layout is None else None
            cache_dir = config.online.cache_dir
            try:
                extractor = OnlineExtractor(
                    online.options,
                    online.facts,
                    online.dataset,
                    Path(cache_dir) if cache_dir else None,
                    engine_devices=online.devices.engine_visible if online.devices else None,
                    writes_cache=rank == 0 and layout is None,
                )
            except CacheFolderError as error:
                raise TrainSetupError(str(error)) from None
            closers.append(extractor.close)
            train_items, val_items = split_items(
                extractor.indices, data.train_ratio, data.split_seed
            )
            train_files = [extractor.sample_path(index) for index in train_items]
            val_files = [extractor.sample_path(index) for index in val_items]
        else:
            train_files, val_files = split_files(str(data_path), data.train_ratio, data.split_seed)

        def loader(file_list: list[Path], transform: Any, iteration: int) -> Any:
            if not file_list:
                return None
            lengths = None
            if extractor is not None:  # the sample index is in the (cache) file name
                items = [int(Path(f).stem.split("_")[-1]) for f in file_list]
                lengths = extractor.lengths(items)
            dataset = Eagle3SampleFileDataset(
                training.total_seq_len,
                file_list=[str(f) for f in file_list],
                transform=transform,
                standardize_fn=standardize,
                seed=training.seed,
                strict=data.strict_data,
                legacy_loss_mask_shift=config.legacy.legacy_loss_mask_shift,
                lengths=lengths,
                output_dtype=torch.bfloat16 if bf16 else None,
                # The verifier's widths are the yardstick: not whichever file comes first.
                widths=(3 * hidden_size, hidden_size),
                # Rows are noised on the training device (the workers only read and pack).
                device_noise=True,
                # fp8 files: dequantized on the device (online rows come dequantized already).
                device_dequantize=extractor is None,
            )
            sampler = MultipackDistributedBatchSamplerV2(
                training.total_seq_len, dataset.lengths, world_size, rank, seed=training.seed
            )
            if extractor is not None and layout is not None:
                return RemoteSampleLoader(
                    layout,
                    transport,
                    dataset,
                    sampler,
                    main_process_noise(create_collate_fn(training.total_seq_len), dataset),
                    iteration,
                    config.online.online_queue_size,
                    collective_device(device),
                )
            if extractor is not None:
                return OnlineLoader(
                    extractor,
                    dataset,
                    items,
                    sampler,
                    main_process_noise(create_collate_fn(training.total_seq_len), dataset),
                    config.online.online_queue_size,
                    exchange,
                )
            # On a GPU the workers pack rows into reused host slots pinned for the copy (#28).
            slots = None
            if device.type == "cuda" and workers > 0 and runtime.row_slots:
                slots = HostRowSlots.for_dataset(
                    dataset,
                    training.total_seq_len,
                    workers * runtime.prefetch_factor,
                    count=VALIDATION_ROW_SLOTS if iteration == VALIDATION_ITERATION else None,
                )
            return SampleFileLoader(
                dataset,
                batch_sampler=sampler,
                collate_fn=create_collate_fn(training.total_seq_len),
                num_workers=workers,
                prefetch_factor=runtime.prefetch_factor if workers else None,
                pin_memory=device.type == "cuda",
                row_slots=slots,
                # Started once: no worker start-up (and empty prefetch window) at every epoch.
                persistent_workers=workers > 0,
            )

        train_loader = loader(train_files, noise_transform(config), TRAIN_ITERATION)
        if train_loader is None or len(train_loader) == 0:
            raise TrainSetupError(
                f"{len(train_files)} training samples make no step for {world_size} processes; "
                "generate more data or use fewer processes"
            )
        val_loader = loader(val_files, None, VALIDATION_ITERATION)
        for opened in (train_loader, val_loader):  # their workers ignore SIGTERM: end them here
            if callable(getattr(opened, "close", None)):
                closers.append(opened.close)
        trainer = Trainer(
            model,
            _trainer_config(config, save_path, distributed, local_rank, device_name),
            train_loader,
            val_loader,
        )
        state = trainer.run_training()
        result = TrainJobResult(
            state=state,
            save_path=save_path,
            rank=rank,
            online=extractor.stats if extractor is not None and layout is None else None,
            received_bytes=transport.bytes_moved if layout is not None else None,
            already_complete=trainer.already_complete,
        )
        if report is not None and rank == 0:
            report(result)
        return result
    except BaseException as error:
        failure = error
        if layout is not None and type(error).__name__ == "TrainingInterrupted":
            stopped_exit.reason, stopped_exit.stopping = str(error), True
        raise
    finally:
        _close_all([*closers, maybe_destroy_distributed], failure)
        if layout is not None and not layout.extracts and stopped_exit.stopping:
            # Every training rank stops at the same step; end this process now, before the
            # interpreter's slow shutdown, where torchrun's SIGTERM (sent as soon as the first
            # rank exits) would kill it with -15 instead of 143.
            stopped_exit()


class _StoppedExit:
    """A split run's training rank: SIGTERM ends it with status 143 and a `stopped:` line.

    torchrun stops every other rank as soon as one exits. When an extraction rank fails, all
    training ranks checkpoint and exit 143 at about the same time; one that is still closing when
    torchrun's SIGTERM comes must end the same way, not be killed by the signal. The trainer
    installs its own handler while it trains and puts this one back after."""

    def __init__(self) -> None:
        self.reason = "SIGTERM"
        self.stopping = False  # the trainer stopped with a checkpoint: the job ends with 143

    @classmethod
    def install(cls) -> _StoppedExit:
        import signal

        handler = cls()
        signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, *_: Any) -> None:
        import sys

        from speculators_vllm016.utils.command_errors import EXIT_STOPPED

        sys.stderr.write(f"stopped: {self.reason}\n")
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)


def _trainer_config(
    config: TrainJobConfig, save_path: Path, distributed: bool, local_rank: int, device: str | None
) -> Any:
    """The trainer's own config from the job's sections."""
    import torch

    from speculators_vllm016.train.trainer import TrainerConfig

    training, runtime, checkpoint = config.training, config.runtime, config.checkpoint
    call = {
        "ttt_steps": config.model.ttt_steps,
        "ttt_step_loss_decay": config.model.ttt_step_loss_decay,
        "use_off_policy_tokens": training.teacher_forcing,
    }
    return TrainerConfig(
        lr=training.lr,
        num_epochs=training.epochs,
        save_path=str(save_path),
        resume_from_checkpoint=not checkpoint.no_resume_from_checkpoint,
        is_distributed=distributed,
        local_rank=local_rank,
        train_call_kwargs=call,
        val_call_kwargs=call,
        scheduler_type=training.scheduler_type,
        scheduler_warmup_steps=training.scheduler_warmup_steps,
        scheduler_total_steps=training.scheduler_total_steps,
        scheduler_num_cosine_cycles=training.scheduler_num_cosine_cycles,
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        seed=training.seed,
        precision=runtime.precision,
        parallel=runtime.parallel,
        device=device,
        checkpoint_freq=checkpoint.checkpoint_freq,
        max_steps=training.max_steps,
        checkpoint_dtype=getattr(torch, CHECKPOINT_DTYPES[checkpoint.checkpoint_dtype]),
        optimizer_state_dtype=torch.bfloat16 if config.legacy.bf16_optimizer_state else None,
        keep_mid_epoch_checkpoints=checkpoint.keep_mid_epoch_checkpoints,
        fsdp_bf16_params=runtime.fsdp_bf16_params,
        deterministic=runtime.deterministic,
        show_progress=not config.logging.no_progress,
    )


def _close_all(closers: list[Callable[[], Any]], failure: BaseException | None) -> None:
    """Call every closer, even after one failed. A closer's error never replaces the error
    already on its way out (`failure`): it is logged. Without one, the first is raised last."""
    first: Exception | None = None
    for close in closers:
        try:
            close()
        except Exception as error:  # noqa: BLE001 - logged or raised below
            if failure is None and first is None:
                first = error
            else:
                logger.error("while closing: %s: %s", type(error).__name__, error)
    if first is not None:
        raise first
