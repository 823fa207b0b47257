"""One training job from its config: prepare -> build the draft and the loaders -> train -> close.

The library entry point of `speculators train` (which only parses the command line into a
`TrainJobConfig`), of `gen-and-train` and of the demo. One process trains on one device; under
torchrun every process runs this with the same config (data-parallel, FSDP2 or DDP). Its parts:
the process's rank and groups (`rank_plan`), the loaders of each data source (`loaders`), the
trainer's settings (`TrainerConfig.from_job_config`).

Training imports no vLLM (it runs where vLLM is absent): every module imported here keeps its
vLLM imports inside the functions that start an engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculators_vllm016.train.checkpointer import TrainingState
from speculators_vllm016.train.jobs.compiler import start_compiler
from speculators_vllm016.train.jobs.draft_build import build_model
from speculators_vllm016.train.jobs.job_config import CONFIG_FILE, TrainJobConfig, save_job_config
from speculators_vllm016.train.jobs.loaders import JobLoaders, build_loaders
from speculators_vllm016.train.jobs.rank_plan import RankPlan, join_ranks
from speculators_vllm016.train.jobs.setup import TrainSetup, prepare
from speculators_vllm016.train.logger import METRICS_FILE, setup_metric_logger, setup_root_logger
from speculators_vllm016.train.online.loader import OnlineStats
from speculators_vllm016.train.online.remote_loader import finish_extraction
from speculators_vllm016.train.trainer import Trainer, TrainingInterrupted
from speculators_vllm016.train.trainer_config import TrainerConfig
from speculators_vllm016.train.utils import maybe_destroy_distributed
from speculators_vllm016.train.vocab_maps import save_vocab_maps
from speculators_vllm016.utils.eagle3_serving import target_serving_line

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
    setup = prepare(config) if setup is None else setup
    ranks = join_ranks(config, setup)
    if ranks is None:  # an extraction rank: it served the training ranks until they were done
        return None
    closers: list[Callable[[], Any]] = []
    if ranks.layout is not None and ranks.transport is not None:
        layout, transport = ranks.layout, ranks.transport
        closers.append(lambda: finish_extraction(layout, transport))
    failure: BaseException | None = None
    try:
        _start_records(config, setup, ranks)
        start_compiler(config.runtime.compile_cache_dir, ranks.device_name)
        model = build_model(config, setup)
        loaders = build_loaders(config, setup, ranks, closers)
        trainer_config = TrainerConfig.from_job_config(
            config,
            save_path=str(setup.save_path),
            is_distributed=ranks.distributed,
            local_rank=ranks.local_rank,
            device=ranks.device_name,
        )
        trainer = Trainer(model, trainer_config, loaders.train, loaders.validation)
        result = _result(trainer.run_training(), trainer, setup.save_path, ranks, loaders)
        if report is not None and ranks.rank == 0:
            report(result)
        return result
    except BaseException as error:
        failure = error
        if ranks.stopped_exit is not None and isinstance(error, TrainingInterrupted):
            ranks.stopped_exit.reason, ranks.stopped_exit.stopping = str(error), True
        raise
    finally:
        _close_all([*closers, maybe_destroy_distributed], failure)
        if ranks.stopped_exit is not None and ranks.stopped_exit.stopping:
            # Every training rank stops at the same step; end this process now, before the
            # interpreter's slow shutdown, where torchrun's SIGTERM (sent as soon as the first
            # rank exits) would kill it with -15 instead of 143.
            ranks.stopped_exit()


def _start_records(config: TrainJobConfig, setup: TrainSetup, ranks: RankPlan) -> None:
    """The job's logs, and on rank 0 its config, serving line and vocabulary maps."""
    setup_root_logger(
        "INFO",
        ranks="local-0" if ranks.layout is None else "rank-0",
        train_steps=config.logging.no_progress,  # a bar shows them otherwise
    )
    save_path, vocab, log = setup.save_path, setup.vocab, config.logging
    save_path.mkdir(parents=True, exist_ok=True)
    if ranks.rank == 0:
        save_job_config(config, save_path / CONFIG_FILE)
        logger.info(
            target_serving_line(
                getattr(setup.verifier_config, "architectures", None) or [],
                str(getattr(setup.text_config, "model_type", "")),
            )
        )
    if ranks.rank == 0 and vocab.built_from:
        save_vocab_maps(vocab, save_path)
        logger.info(
            "vocabulary maps built from %s -> %s/{d2t,t2d}.npy", vocab.built_from, save_path
        )
    setup_metric_logger(log.logger, log.run_name, log.log_dir, jsonl_path=save_path / METRICS_FILE)


def _result(
    state: TrainingState, trainer: Trainer, save_path: Path, ranks: RankPlan, loaders: JobLoaders
) -> TrainJobResult:
    return TrainJobResult(
        state=state,
        save_path=save_path,
        rank=ranks.rank,
        online=loaders.online_stats,
        received_bytes=ranks.transport.bytes_moved if ranks.transport is not None else None,
        already_complete=trainer.already_complete,
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
