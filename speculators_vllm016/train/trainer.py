"""The training loop: packed rows in, optimizer steps, validation, checkpoints, exact resume.

`Trainer(model, config, train_loader, val_loader)` is 0.3.0's API (`TrainerConfig` lives in
`trainer_config`; 0.3.0 imported it from here, so it still imports from here). What the trainer
asks of a loader is the `TrainingLoader` Protocol and its optional capabilities
(`loading.loader_contract`). The loaders yield
`PackedBatch` rows (`speculators_vllm016.train.data`); the model returns its loss and metrics
(`train.draft_contract`: a `DraftOutput`, or 0.3.0's `(draft_tokens, loss, metrics)` tuple).

The run's progress is one explicit `TrainingState` (epoch, step in epoch, global step, best
validation score) saved with every checkpoint together with each rank's RNG states; with the
sampler's deterministic plan per epoch and per-sample noise seeds, a resumed run continues with
exactly the batches, noise and optimizer state of an uninterrupted one.

This module is the loop; its parts live beside it: one step (`train_step.TrainStep`), rows to
the device (`device_rows`), checkpoints and their retention (`checkpointer`), what a resumed run
continues from (`resume`), the metrics log and its life across runs (`metrics_log`), stopping on
SIGTERM or Ctrl-C (`graceful_shutdown`), one process per save path (`save_lock`), RNG states
that load without running code (`rng_state`), checkpoint files whose failures say what happened
(`checkpoint_files`), and the one-line failures a run reports (`errors`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import PreTrainedModel

from speculators_vllm016.models.eagle3.model_definitions import use_reproducible_compilation
from speculators_vllm016.train.checkpointer import (
    BaseCheckpointer,
    CheckpointRef,
    DistributedCheckpointer,
    SingleGPUCheckpointer,
    TrainingState,
    remove_temporary_folders,
)
from speculators_vllm016.train.checkpointing.rng_state import restore_rng_state
from speculators_vllm016.train.checkpointing.save_lock import SavePathLock
from speculators_vllm016.train.data import DataSourceError, PackedBatch
from speculators_vllm016.train.draft_contract import StoresFrozenWeights
from speculators_vllm016.train.errors import NothingTrained, SavePathInUse
from speculators_vllm016.train.graceful_shutdown import GracefulShutdown
from speculators_vllm016.train.jobs.resume import (
    apply_resumed_settings,
    optimizer_settings,
    reconcile_resumed_state,
    training_data_digest,
)
from speculators_vllm016.train.loading.device_rows import StepRow, prefetch_to_device, to_step_row
from speculators_vllm016.train.loading.loader_contract import (
    ReadsAcrossEpochs,
    ReportsProgress,
    ReportsStepMetrics,
    SetsEpoch,
    TrainingLoader,
    unreadable_files,
)
from speculators_vllm016.train.lr_schedule import build_lr_scheduler, default_warmup_steps
from speculators_vllm016.train.metrics_log import (
    MetricsLog,
    log_train_step,
    log_validation,
)
from speculators_vllm016.train.train_step import (
    TrainStep,
    build_optimizer,
    collective_device,
    validation_means,
)
from speculators_vllm016.train.trainer_config import TrainerConfig
from speculators_vllm016.train.utils import (
    apply_data_parallel,
    apply_fully_sharded,
    training_device,
)
from speculators_vllm016.utils.errors import InvalidInputError, RunStopped

__all__ = ["Trainer", "TrainerConfig", "TrainingInterrupted"]

root_logger = logging.getLogger("speculators")


class TrainingInterrupted(RunStopped):
    """Training stopped on SIGTERM or Ctrl-C after writing a checkpoint (exit 143 or 130)."""


class Trainer:
    """Trains a draft model on packed rows; see `TrainerConfig` for the knobs."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        train_loader: TrainingLoader,
        val_loader: TrainingLoader | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.local_rank = config.local_rank
        self.is_distributed = config.is_distributed
        self.world_size = dist.get_world_size() if self.is_distributed else 1
        self.rank = dist.get_rank() if self.is_distributed else 0
        self.resume_from_checkpoint = config.resume_from_checkpoint
        self.device = training_device(self.local_rank, config.device)
        precision = config.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        sharded = self.is_distributed and config.parallel == "fsdp"
        checkpointer_class = DistributedCheckpointer if sharded else SingleGPUCheckpointer
        self.checkpointer: BaseCheckpointer = checkpointer_class(
            config.save_path,
            keep_mid_epoch=config.keep_mid_epoch_checkpoints,
            keep_last=config.keep_last_checkpoints,
            background=config.background_checkpoints,
        )
        self.metrics_log = MetricsLog(config.save_path, self.rank)
        self.shutdown = GracefulShutdown()
        self.data_digest = training_data_digest(self.train_loader)
        self.state = TrainingState(
            seed=config.seed,
            world_size=self.world_size,
            data_digest=self.data_digest,
            deterministic=config.deterministic,
        )
        self.resume_ref: CheckpointRef | None = None
        self.already_complete = False  # resumed at (or past) its last epoch or --max-steps
        self._pending_rng: dict[str, Any] | None = None
        self._wrote_checkpoint = False
        self._first_step = 0
        self.save_lock = SavePathLock(config.save_path)
        weakref.finalize(self, self.save_lock.release)  # a trainer dropped without running
        self.lock_save_path()
        try:
            self.setup_trainer()
            self.setup_model()
            self.setup_optimizer()
        except BaseException:
            self.save_lock.release()
            raise

    def lock_save_path(self) -> None:
        """Hold the save path for this run (rank 0, for all ranks): a second process training
        into it is refused with its holder's pid (`save_lock`). Every rank learns the answer."""
        refused: SavePathInUse | None = None
        if self.rank == 0:
            try:
                self.save_lock.acquire()
            except SavePathInUse as error:
                refused = error
        if self.is_distributed:
            flag = torch.tensor(
                [0.0 if refused is None else 1.0], device=collective_device(self.device)
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if refused is None and flag.item() > 0:
                refused = SavePathInUse(
                    f"rank 0 found another training process training into {self.config.save_path}"
                )
        if refused is not None:
            raise refused

    # -- set-up --------------------------------------------------------------------------------
    def setup_trainer(self) -> None:
        """Pick the checkpoint to resume from (the newest complete one), if asked to resume."""
        if self.rank == 0:
            remove_temporary_folders(Path(self.config.save_path))  # may put a checkpoint back
            self.metrics_log.recover_unconfirmed_run()
        if self.is_distributed:
            dist.barrier()
        self.checkpointer.refresh()
        latest = self.checkpointer.latest
        if latest is None:
            root_logger.info("no checkpoint in %s: %s", self.config.save_path, self.config.start)
            return
        if not self.resume_from_checkpoint:
            self.checkpointer.replace_earlier_run()
            root_logger.warning(
                "resume is off: training from scratch; the %d checkpoints of the earlier run in %s "
                "are deleted when this run finishes its first epoch (or its last step, if sooner); "
                "until then it writes no checkpoint, and stopped before that it leaves the earlier "
                "run as it was (%s moves to %s.prev when training starts)",
                len(self.checkpointer.earlier_run),
                self.config.save_path,
                self.metrics_log.path.name,
                self.metrics_log.path.name,
            )
            return
        self.resume_ref = latest
        self.state = reconcile_resumed_state(
            latest,
            steps_per_epoch=len(self.train_loader),
            world_size=self.world_size,
            seed=self.config.seed,
            data_digest=self.data_digest,
            deterministic=self.config.deterministic,
        )
        epoch, step = self.state.resume_position()
        self.already_complete = epoch >= self.config.num_epochs or self._reached_max_steps()
        if self.already_complete:
            limit = (
                "--max-steps"
                if self._reached_max_steps() and epoch < self.config.num_epochs
                else "--epochs"
            )
            root_logger.info(
                "the run in %s is already complete (%d steps, %s; newest checkpoint %s): nothing "
                "to train; to train more, raise %s and run the same command",
                self.config.save_path,
                self.state.global_step,
                self._epoch_range(),
                latest.name,
                limit,
            )
            return
        root_logger.info("resuming from %s at epoch %d, step %d", latest.path, epoch, step)

    def setup_model(self) -> None:
        """Move the model to its device, wrap it for data parallelism, load resumed weights."""
        model = self.model.to(self.device)
        use_reproducible_compilation(self.config.deterministic)
        if self.autocast_dtype is not None and isinstance(model, StoresFrozenWeights):
            # The frozen verifier copies are only ever read in bf16 under autocast (and came
            # from a bf16 checkpoint): bf16 storage saves 1.3 GB at 8B shapes and the casts.
            model.frozen_weights_to(self.autocast_dtype)
        sharded = self.is_distributed and self.config.parallel == "fsdp"
        if sharded:
            apply_fully_sharded(model, torch.bfloat16 if self.config.fsdp_bf16_params else None)
        if self.resume_ref is not None:
            started = time.perf_counter()
            self.checkpointer.load_model_state_dict(model, checkpoint=self.resume_ref.path)
            root_logger.info(
                "weights of %s loaded in %.2f s",
                self.resume_ref.path,
                time.perf_counter() - started,
            )
        if self.is_distributed and not sharded:
            self.wrapped = apply_data_parallel(model, self.device)
        else:
            self.wrapped = model
        self.model = model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    def setup_optimizer(self) -> None:
        """AdamW over the model's parameters (frozen ones get no update), the LR schedule, and
        the step that uses them."""
        config = self.config
        self.opt = build_optimizer(self.model, config.lr, config.weight_decay, self.device)
        run_steps = self._total_steps()
        warmup = (
            default_warmup_steps(run_steps)
            if config.scheduler_warmup_steps is None
            else config.scheduler_warmup_steps
        )
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = build_lr_scheduler(
            self.opt,
            config.scheduler_type,
            run_steps=run_steps,
            warmup_steps=warmup,
            total_steps=config.scheduler_total_steps,
            num_cosine_cycles=config.scheduler_num_cosine_cycles,
        )
        settings = optimizer_settings(
            lr=config.lr,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            scheduler_type=config.scheduler_type,
            warmup_steps=warmup,
            total_steps=config.scheduler_total_steps or run_steps,
            num_cosine_cycles=config.scheduler_num_cosine_cycles,
        )
        recorded, self.state.optimizer = self.state.optimizer, settings
        self.step_runner = TrainStep(
            model=self.wrapped,
            optimizer=self.opt,
            parameters=self.trainable_parameters(),
            device=self.device,
            max_grad_norm=self.config.max_grad_norm,
            call_options=self.config.train_call_kwargs,
            autocast_dtype=self.autocast_dtype,
            scheduler=self.scheduler,
            distributed=self.is_distributed,
            world_size=self.world_size,
        )
        if self.resume_ref is None:
            return
        # The optimizer state restores each group's current learning rate: load it after the
        # scheduler's construction has set its own, and the scheduler's position after that.
        started = time.perf_counter()
        self.checkpointer.load_optimizer_state_dict(
            self.model, self.opt, torch.float32, checkpoint=self.resume_ref.path
        )
        if self.scheduler is not None:
            self.checkpointer.load_scheduler_state_dict(
                self.scheduler, checkpoint=self.resume_ref.path
            )
        if not self.already_complete:  # this run's settings, from the resumed step on
            apply_resumed_settings(
                self.opt, self.scheduler, recorded, settings, self.state.global_step
            )
        root_logger.info(
            "optimizer state of %s loaded in %.2f s",
            self.resume_ref.path,
            time.perf_counter() - started,
        )

    def _total_steps(self) -> int:
        total = self.config.num_epochs * len(self.train_loader)
        if self.config.max_steps is not None:
            total = min(total, self.config.max_steps)
        return max(total, 1)

    def state_dict(self) -> dict[str, Any]:
        """The run's progress (what `training_state.json` holds)."""
        return dataclasses.asdict(self.state)

    # -- progress and one step -----------------------------------------------------------------
    def train_step(self, batch: PackedBatch | StepRow) -> dict[str, float]:
        """Forward, backward, clip, optimizer and scheduler step on one packed row."""
        metrics = self.step_runner(to_step_row(batch, self.device, self.model))
        if not math.isfinite(metrics["grad_norm"]):
            root_logger.warning(
                "step %d: NaN or inf in the loss or its gradients; this update was skipped "
                "(weights and optimizer state unchanged)",
                self.state.global_step,
            )
        return metrics

    # -- epochs --------------------------------------------------------------------------------
    def _epoch_batches(self, loader: TrainingLoader, epoch: int, start_step: int) -> Iterator[Any]:
        if isinstance(loader, ReadsAcrossEpochs):
            return loader.epoch_rows(epoch, start_step, last_epoch=self.config.num_epochs - 1)
        sampler = loader.batch_sampler
        if isinstance(sampler, SetsEpoch):
            try:
                sampler.set_epoch(epoch, start_step)
            except TypeError:  # a 0.3.0-style sampler without positions
                if start_step:
                    raise InvalidInputError(
                        "this batch sampler cannot start inside an epoch"
                    ) from None
                sampler.set_epoch(epoch)
        if isinstance(loader.dataset, SetsEpoch):
            loader.dataset.set_epoch(epoch)
        return iter(loader)

    @property
    def replaces_earlier_run(self) -> bool:
        """A run from scratch over an earlier run's checkpoints that has not yet finished its
        first epoch (or its last step): it writes no checkpoint, so that stopping it (Ctrl-C,
        SIGTERM, an error) leaves the earlier run as it was; only its end-of-epoch or final
        checkpoint replaces the earlier run."""
        return bool(self.checkpointer.earlier_run)

    def _kept_earlier_run(self) -> str:
        return (
            f"this run had not finished its first epoch: nothing of it was saved, and the "
            f"earlier run in {self.config.save_path} is left as it was"
        )

    def _data_source_failed(self, error: DataSourceError) -> RuntimeError:
        """Checkpoint where the run stands; the error that tells the user to rerun."""
        if self.replaces_earlier_run:
            return DataSourceError(f"{error}; {self._kept_earlier_run()}")
        if self.state.global_step == self._first_step:  # e.g. the engine did not start
            return DataSourceError(f"{error}; no step had run, so nothing was saved")
        path = self._save_mid_epoch()
        return TrainingInterrupted(
            f"{error}; checkpoint {path} at step {self.state.global_step}; "
            "run the same command again to resume"
        )

    def train_epoch(self, epoch: int, *, start_step: int = 0) -> bool:
        """Train one epoch from `start_step`; False when stopped early (max_steps)."""
        self.wrapped.train()
        rows = prefetch_to_device(
            self._epoch_batches(self.train_loader, epoch, start_step), self.device, self.model
        )
        steps = len(self.train_loader)  # the plan of this epoch (packing varies per epoch)
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)  # after the loader drew its worker seeds
            self._pending_rng = None
        every = None
        if self.config.checkpoint_freq:
            every = max(1, round(self.config.checkpoint_freq * steps))
        progress = tqdm(
            total=steps,
            initial=start_step,
            desc=f"epoch {epoch} ({self._epoch_range()})",
            disable=not self.config.show_progress or self.rank != 0,
            dynamic_ncols=True,
        )
        started, tokens, trained = time.perf_counter(), 0.0, 0.0
        last_end = started
        self.state.epoch, self.state.epoch_complete = epoch, False
        self.state.step_in_epoch = start_step
        try:
            for step in range(start_step, steps):
                waiting = time.perf_counter()
                try:
                    row = next(rows)
                except DataSourceError as error:
                    raise self._data_source_failed(error) from error
                data_wait = time.perf_counter() - waiting  # the loader's share of step_seconds
                metrics = self.train_step(row)
                metrics["data_wait_seconds"] = data_wait
                step_trained, last_end = self._log_step(metrics, epoch, last_end)
                trained, tokens = trained + step_trained, tokens + metrics["tokens"]
                self.state.step_in_epoch = step + 1
                self.state.global_step += 1
                rate = tokens / max(time.perf_counter() - started, 1e-9)
                loader = self.train_loader  # online: the extraction's side too
                progress.set_postfix(
                    loss=f"{metrics.get('loss', float('nan')):.3f}",
                    acc=f"{metrics.get('full_acc_0', float('nan')):.3f}",
                    tok_s=f"{rate:,.0f}",
                    **(loader.progress_fields() if isinstance(loader, ReportsProgress) else {}),
                )
                progress.update(1)
                self.checkpointer.writer.raise_failure()  # a background write failed: stop
                last = step + 1 == steps
                self._stop_if_asked()
                if (
                    self.config.max_steps is not None
                    and self.state.global_step >= self.config.max_steps
                ):
                    if not last:
                        self._check_trained(epoch, start_step, step + 1, trained)
                        self._save_mid_epoch()
                        return False
                if every and not last and (step + 1) % every == 0 and not self.replaces_earlier_run:
                    self._save_mid_epoch()
        finally:
            progress.close()
        self._check_trained(epoch, start_step, steps, trained)
        return True

    def _log_step(
        self, metrics: dict[str, float], epoch: int, last_end: float
    ) -> tuple[float, float]:
        """Count one step's metrics into the run's state and log them; returns the tokens the
        step trained on and when it ended (`last_end`: when the step before it ended)."""
        if isinstance(self.train_loader, ReportsStepMetrics):  # split online: bytes moved
            metrics.update(self.train_loader.step_metrics())
        # A float averaged over ranks and multiplied back: 5 on 3 ranks is 4.9999998.
        skipped = round(metrics.pop("skipped_samples"))
        if skipped:  # named in the log where it happened; counted here and in the metrics
            self.state.skipped_samples += skipped
            metrics["skipped_samples"] = skipped
        self.state.last_loss = metrics.get("loss")
        trained = metrics.pop("trained_tokens", metrics["tokens"])
        # Wall-clock seconds since the previous step ended, waiting for data included
        # (train_step returns after its metrics reached the host: the step is done).
        now = time.perf_counter()
        metrics["step_seconds"] = now - last_end
        if self.device.type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        lr = metrics.pop("lr")
        log_train_step(self.state.global_step, epoch, lr, metrics)  # step counts from 0
        return trained, now

    def _stop_if_asked(self) -> None:
        """After a step: a SIGTERM or Ctrl-C on any rank stops the run with a checkpoint (none
        while an earlier run's checkpoints would be replaced: those stay as they were)."""
        if not self.shutdown.requested_on_any_rank(
            self.is_distributed, collective_device(self.device)
        ):
            return
        if self.replaces_earlier_run:
            raise TrainingInterrupted(
                f"stopped by {self.shutdown.reason} at step {self.state.global_step}; "
                f"{self._kept_earlier_run()}",
                signum=self.shutdown.signum,
            )
        path = self._save_mid_epoch()
        raise TrainingInterrupted(
            f"stopped by {self.shutdown.reason} at step {self.state.global_step}; "
            f"checkpoint {path}; run the same command again to resume",
            signum=self.shutdown.signum,
        )

    def _check_trained(self, epoch: int, first: int, end: int, trained: float) -> None:
        """Refuse to go on (and to save) after steps `first`..`end` of `epoch` trained no token:
        every row was empty (all its samples unusable) or had no token with a loss."""
        if end <= first or trained > 0:
            return
        where = f"epoch {epoch}" if first == 0 else f"steps {first + 1}-{end} of epoch {epoch}"
        raise NothingTrained(
            f"{where} trained no token: none of its {end - first} rows held a token to learn from "
            "(every sample unusable: see the warnings above, or --total-seq-len too short for "
            "them); stopped without saving"
        )

    def val_epoch(self, epoch: int) -> dict[str, float] | None:
        """Mean validation metrics over the validation rows (and tau_sim), logged as `val`."""
        if self.val_loader is None:
            return None
        self.wrapped.eval()
        batches = tqdm(
            self._epoch_batches(self.val_loader, epoch, 0),
            total=len(self.val_loader),
            desc="validation",
            disable=not self.config.show_progress or self.rank != 0,
            dynamic_ncols=True,
        )
        means = validation_means(
            self.wrapped,
            (to_step_row(batch, self.device, self.model) for batch in batches),
            self.device,
            self.autocast_dtype,
            self.config.val_call_kwargs,
            self.world_size if self.is_distributed else None,
        )
        if means is not None:
            log_validation(self.state.global_step, epoch, means)
        return means

    # -- checkpoints ---------------------------------------------------------------------------
    def _save(self, name: str, *, best: bool = False) -> Path:
        """Checkpoint `name`, returning while it may still be written; once in place, the
        metrics log's marker goes, `best` points at it if `best`, and retention runs."""
        self._wrote_checkpoint = True  # from here on the earlier run is gone

        def written(path: Path) -> None:
            self.metrics_log.confirm()
            if best:
                self.checkpointer.point_best(path.name)
            self.checkpointer.apply_retention(path.name)

        started = time.perf_counter()
        path = self.checkpointer.save(
            name,
            self.wrapped,
            self.opt,
            self.scheduler,
            self.state,
            float_dtype=self.config.checkpoint_dtype,
            optimizer_dtype=self.config.optimizer_state_dtype,
            then=written,
        )
        root_logger.info(
            "checkpoint %s: the step loop waited %.2f s", path, time.perf_counter() - started
        )
        return path

    def _save_mid_epoch(self) -> Path:
        return self._save(f"{self.state.epoch}-step{self.state.global_step}")

    def save_checkpoint(self, epoch: int, *, best: bool = False) -> Path:
        """The end-of-epoch checkpoint `<save>/<epoch>` (0.3.0's name)."""
        self.state.epoch, self.state.epoch_complete = epoch, True
        self.state.step_in_epoch = len(self.train_loader)
        return self._save(str(epoch), best=best)

    # -- the run -------------------------------------------------------------------------------
    def run_training(self) -> TrainingState:
        """Train to the end (or `max_steps`); returns the final progress."""
        self.lock_save_path()  # held since construction, unless an earlier run_training ended
        try:
            return self._run()
        finally:
            self.save_lock.release()  # the run is over: another may use the save path

    def _run(self) -> TrainingState:
        self._pending_rng = None
        self._first_step = self.state.global_step  # where this run starts
        self.state.unreadable_files = unreadable_files(self.train_loader, self.val_loader)
        moved_metrics = False
        if self.resume_ref is None:
            moved_metrics = self.metrics_log.start(
                replaces_checkpoints=bool(self.checkpointer.earlier_run)
            )
        else:
            self.metrics_log.truncate_after(self.state.global_step)
            if not self.resume_ref.legacy:
                self._pending_rng = self.checkpointer.load_rng_state(self.resume_ref.path)
        try:
            with self.shutdown.installed(self.config.handle_sigterm):
                self._train_epochs()
            self.checkpointer.wait()  # the last checkpoint is in place when the run returns
        except BaseException:
            self._wait_for_checkpoint_quietly()
            if moved_metrics and not self._wrote_checkpoint:
                # Stopped before its first checkpoint: the earlier run's metrics come back.
                self.metrics_log.restore_earlier()
            raise
        return self.state

    def _wait_for_checkpoint_quietly(self) -> None:
        """A run stopping on an error still finishes the checkpoint being written (whose own
        failure is logged: the first error is the one raised)."""
        try:
            self.checkpointer.wait()
        except Exception as error:  # noqa: BLE001
            root_logger.error("the checkpoint being written failed too: %s", error)

    def _train_epochs(self) -> None:
        start_epoch, start_step = self.state.resume_position()
        if self._reached_max_steps():
            return
        for epoch in range(start_epoch, self.config.num_epochs):
            root_logger.info("epoch %d (%s)", epoch, self._epoch_range())
            if not self.train_epoch(epoch, start_step=start_step if epoch == start_epoch else 0):
                return
            try:
                validation = self.val_epoch(epoch)
            except DataSourceError as error:  # online: the engine died while validating
                # The epoch's steps are done; the resumed run validates.
                raise self._data_source_failed(error) from error
            score = validation.get("tau_sim") if validation else None
            self.state.val_tau_sim = score
            improved = score is not None and (
                self.state.best_val_tau_sim is None or score > self.state.best_val_tau_sim
            )
            if improved:
                self.state.best_val_tau_sim, self.state.best_checkpoint = score, str(epoch)
            self.save_checkpoint(epoch, best=improved)
            if self._reached_max_steps():
                return

    def _epoch_range(self) -> str:
        """The run's epochs as the checkpoint folders number them (from 0, 0.3.0's names)."""
        last = self.config.num_epochs - 1
        return f"epochs 0 to {last}" if last else "epoch 0 only"

    def _reached_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.state.global_step >= self.config.max_steps

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        return self.state.resume_position()[0]
