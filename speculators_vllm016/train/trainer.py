"""The training loop: packed rows in, optimizer steps, validation, checkpoints, exact resume.

`Trainer(model, config, train_loader, val_loader)` is 0.3.0's API. The loaders yield
`PackedBatch` rows (`speculators_vllm016.train.data`); the model returns its loss and metrics
(an output with `.loss` / `.metrics`, or 0.3.0's `(draft_tokens, loss, metrics)` tuple).

The run's progress is one explicit `TrainingState` (epoch, step in epoch, global step, best
validation score) saved with every checkpoint together with each rank's RNG states; with the
sampler's deterministic plan per epoch and per-sample noise seeds, a resumed run continues with
exactly the batches, noise and optimizer state of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import (
    PreTrainedModel,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from speculators_vllm016.models.eagle3.model_definitions import use_reproducible_compilation
from speculators_vllm016.train.checkpointer import (
    BaseCheckpointer,
    CheckpointRef,
    DistributedCheckpointer,
    SingleGPUCheckpointer,
    TrainingState,
    remove_temporary_folders,
    restore_rng_state,
)
from speculators_vllm016.train.data import MODEL_INPUTS, DataSourceError, Eagle3SampleFileDataset
from speculators_vllm016.train.logger import METRICS_FILE, METRICS_LOGGER
from speculators_vllm016.train.optimizer_step import clip_and_step
from speculators_vllm016.train.utils import (
    apply_data_parallel,
    apply_fully_sharded,
    training_device,
)

__all__ = ["Trainer", "TrainerConfig", "TrainingInterrupted", "tau_sim"]

root_logger = logging.getLogger("speculators")
metric_logger = logging.getLogger(METRICS_LOGGER)

# Present while a run from scratch has moved the earlier run's metrics to `.prev` but written
# no checkpoint yet. A run killed then (SIGKILL, power loss) leaves it, and the next start puts
# the earlier run's metrics back beside the earlier run's checkpoints, which are still there.
UNCONFIRMED_RUN_FILE = ".run-without-checkpoint"


@dataclass(frozen=True)
class TrainerConfig:
    """How to train. The first twelve fields are 0.3.0's `TrainerConfig`, in its order.

    lr, num_epochs, save_path: learning rate, epochs, checkpoint folder.
    resume_from_checkpoint: continue from the newest complete checkpoint in `save_path`.
    is_distributed, local_rank: set by `maybe_setup_distributed()` under torchrun.
    train_call_kwargs / val_call_kwargs: extra keyword arguments of the model call
        (`ttt_steps`, `ttt_step_loss_decay`, `use_off_policy_tokens`).
    scheduler_*: linear or cosine decay with warm-up, or none. The default warm-up is 1% of the
        run's steps (epochs x steps per epoch, capped at `max_steps`: 0.3.0's value without it).
    weight_decay, max_grad_norm: AdamW's decay and the gradient clipping norm.
    seed: seeds the sampler's shuffles and the noise (set on the loaders by the caller).
    precision: "fp32", or "bf16" (bf16 autocast over fp32 master weights); "auto" is bf16 on
        CUDA and fp32 on CPUs.
    parallel: "fsdp" (FSDP2, shards weights and optimizer state) or "ddp" under torchrun.
    fsdp_bf16_params: under FSDP2, gather bf16 copies of the weights instead of the fp32
        masters (half the traffic, less memory; norms then scale by bf16 weights).
    deterministic: compile the draft's blocks so that a GPU run's numbers do not depend on the
        shapes compiled before (`use_reproducible_compilation`): a resumed run then ends with the
        uninterrupted run's weights bit for bit, as CPU runs always do. Slower (7% a step on an
        H200 at 8B-draft shapes, one measurement).
    device: where to train ("cpu", "cuda"); default: this rank's GPU, else the CPU.
    checkpoint_freq: also checkpoint every this fraction of an epoch (0.25: four times).
    max_steps: stop (with a checkpoint) after this many optimizer steps in all.
    checkpoint_dtype: dtype of the served `model.safetensors` (fp32 masters are kept beside it).
    optimizer_state_dtype: None keeps the optimizer state as it is (fp32); bf16 is 0.3.0's D2.
    keep_mid_epoch_checkpoints: how many mid-epoch checkpoints after the newest epoch one to keep
        (older ones are deleted; epoch ones stay). The checkpoint just written is never deleted,
        so 0 keeps just that one, like 1.
    """

    lr: float
    num_epochs: int
    save_path: str
    resume_from_checkpoint: bool = False
    is_distributed: bool = False
    local_rank: int = 0
    train_call_kwargs: dict = field(default_factory=dict)
    val_call_kwargs: dict = field(default_factory=dict)
    scheduler_type: Literal["linear", "cosine", "none"] = "linear"
    scheduler_warmup_steps: int | None = None
    scheduler_total_steps: int | None = None
    scheduler_num_cosine_cycles: float = 0.5
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    parallel: Literal["fsdp", "ddp"] = "fsdp"
    device: str | None = None
    checkpoint_freq: float | None = None
    max_steps: int | None = None
    checkpoint_dtype: torch.dtype = torch.bfloat16
    optimizer_state_dtype: torch.dtype | None = None
    keep_mid_epoch_checkpoints: int = 1
    fsdp_bf16_params: bool = False
    deterministic: bool = False
    show_progress: bool = True
    handle_sigterm: bool = True

    def _replace(self, **changes: Any) -> TrainerConfig:
        """NamedTuple-style copy with changes (0.3.0's config was a NamedTuple)."""
        return dataclasses.replace(self, **changes)


class TrainingInterrupted(RuntimeError):
    """Training stopped on SIGTERM or Ctrl-C after writing a checkpoint; run the same command to resume."""


def default_warmup_steps(run_steps: int) -> int:
    """1% of the steps this run trains (0.3.0's default, which ignored a step cap)."""
    return run_steps // 100


def tau_sim(metrics: dict[str, float]) -> float | None:
    """1 + sum over TTT steps of `full_acc_k`: the acceptance length a greedy chain would reach."""
    accuracies = [value for key, value in metrics.items() if key.startswith("full_acc_")]
    return 1.0 + sum(accuracies) if accuracies else None


def _unpack_output(output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from a typed model output or 0.3.0's `(draft_tokens, loss, metrics)`."""
    if hasattr(output, "loss") and hasattr(output, "metrics"):
        loss, metrics = output.loss, output.metrics
    else:
        _, loss, metrics = output
    if loss is None:
        raise ValueError("the model returned no loss: the batch lacks verifier_last_hidden_states")
    return loss, dict(metrics or {})


class Trainer:
    """Trains a draft model on packed rows; see `TrainerConfig` for the knobs."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        train_loader: DataLoader,
        val_loader: DataLoader | None = None,
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
        self.checkpointer: BaseCheckpointer = checkpointer_class(config.save_path)
        self.data_digest = self._data_digest()
        self.state = TrainingState(seed=config.seed, world_size=self.world_size,
                                   data_digest=self.data_digest, deterministic=config.deterministic)
        self.resume_ref: CheckpointRef | None = None
        self._stop_requested = False
        self._stop_reason = "a stop signal on another rank"
        self._handler_pid = os.getpid()
        self._pending_rng: dict[str, Any] | None = None
        # Checkpoints of an earlier run a from-scratch run found: removed at its first save.
        self._earlier_run: list[CheckpointRef] = []
        self._wrote_checkpoint = False
        if config.keep_mid_epoch_checkpoints < 0:
            raise ValueError(f"keep_mid_epoch_checkpoints must be >= 0, got {config.keep_mid_epoch_checkpoints}")
        self.setup_trainer()
        self.setup_model()
        self.setup_optimizer()

    # -- set-up --------------------------------------------------------------------------------
    def setup_trainer(self) -> None:
        """Pick the checkpoint to resume from (the newest complete one), if asked to resume."""
        if self.rank == 0:
            remove_temporary_folders(Path(self.config.save_path))
            if self._unconfirmed_marker.is_file():
                self._restore_earlier_metrics()
                root_logger.warning(
                    "an earlier run from scratch in %s ended before its first checkpoint, without "
                    "cleaning up (killed?): the metrics of the run whose checkpoints are there are "
                    "back in %s, its own lines are in %s.prev",
                    self.config.save_path, METRICS_FILE, METRICS_FILE,
                )
        latest = self.checkpointer.latest
        if latest is None:
            root_logger.info("no checkpoint in %s: starting from scratch", self.config.save_path)
            return
        if not self.resume_from_checkpoint:
            self._earlier_run = list(self.checkpointer.checkpoints)
            root_logger.warning(
                "resume is off: training from scratch; the %d checkpoints of the earlier run in %s "
                "are deleted when this run writes its first checkpoint (%s moves to %s.prev "
                "when training starts)", len(self._earlier_run), self.config.save_path,
                METRICS_FILE, METRICS_FILE,
            )
            return
        self.resume_ref = latest
        self.state = dataclasses.replace(latest.state)
        if latest.legacy:
            # 0.3.0 kept no step counter: the end of epoch e is (e + 1) epochs of steps.
            self.state.global_step = (latest.state.epoch + 1) * len(self.train_loader)
        if self.state.world_size != self.world_size:
            root_logger.warning(
                "checkpoint written with %d processes, resuming with %d: the batches of the rest "
                "of the run differ from an uninterrupted one", self.state.world_size, self.world_size,
            )
            self.state.world_size = self.world_size
        if not latest.legacy and self.state.seed != self.config.seed:
            root_logger.warning(
                "checkpoint written with --seed %d, resuming with --seed %d: the batches and noise "
                "of the rest of the run differ from an uninterrupted one",
                self.state.seed, self.config.seed,
            )
        self.state.seed = self.config.seed  # the seed the rest of the run uses
        digest = self.data_digest
        if self.state.data_digest is not None and digest is not None and self.state.data_digest != digest:
            root_logger.warning(
                "checkpoint written for other training data (sample files added, removed or "
                "changed length): the batches of the rest of the run differ from an "
                "uninterrupted one"
            )
        self.state.data_digest = digest
        recorded = self.state.deterministic
        if recorded is not None and recorded != self.config.deterministic:
            root_logger.warning(
                "checkpoint written %s --deterministic, resuming %s it: on a GPU the rest of the "
                "run does not end bit for bit where an uninterrupted one would",
                "with" if recorded else "without", "without" if recorded else "with",
            )
        self.state.deterministic = self.config.deterministic
        epoch, step = self.state.resume_position()
        root_logger.info("resuming from %s at epoch %d, step %d", latest.path, epoch, step)

    def _data_digest(self) -> str | None:
        """A hash of the training files' names and token counts, in order (None when the
        loader's dataset does not list them)."""
        dataset = getattr(self.train_loader, "dataset", None)
        if not isinstance(dataset, Eagle3SampleFileDataset):
            return None
        digest = hashlib.sha256()
        for path, length in zip(dataset.data, dataset.lengths, strict=True):
            digest.update(f"{Path(path).name}\t{int(length)}\n".encode())
        return digest.hexdigest()[:16]

    def setup_model(self) -> None:
        """Move the model to its device, wrap it for data parallelism, load resumed weights."""
        model = self.model.to(self.device)
        use_reproducible_compilation(self.config.deterministic)
        if self.autocast_dtype is not None and hasattr(model, "frozen_weights_to"):
            # The frozen verifier copies are only ever read in bf16 under autocast (and came
            # from a bf16 checkpoint): bf16 storage saves 1.3 GB at 8B shapes and the casts.
            model.frozen_weights_to(self.autocast_dtype)
        sharded = self.is_distributed and self.config.parallel == "fsdp"
        if sharded:
            apply_fully_sharded(model, torch.bfloat16 if self.config.fsdp_bf16_params else None)
        if self.resume_ref is not None:
            started = time.perf_counter()
            self.checkpointer.load_model_state_dict(model, checkpoint=self.resume_ref.path)
            root_logger.info("weights of %s loaded in %.2f s", self.resume_ref.path,
                             time.perf_counter() - started)
        if self.is_distributed and not sharded:
            self.wrapped = apply_data_parallel(model, self.device)
        else:
            self.wrapped = model
        self.model = model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    def setup_optimizer(self) -> None:
        """AdamW over the model's parameters (frozen ones get no update) and the LR schedule."""
        # Fused AdamW also takes FSDP2's sharded (DTensor) parameters: one kernel per group
        # of tensors instead of foreach's several, about 3 ms a step at 8B-draft shapes.
        self.opt = torch.optim.AdamW(
            list(self.model.named_parameters()),
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            fused=(self.device.type == "cuda") or None,
        )
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = self._make_scheduler()
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
        root_logger.info("optimizer state of %s loaded in %.2f s", self.resume_ref.path,
                         time.perf_counter() - started)

    def _make_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        if self.config.scheduler_type == "none":
            return None
        total = self.config.scheduler_total_steps or self._total_steps()
        warmup = self.config.scheduler_warmup_steps
        if warmup is None:
            warmup = default_warmup_steps(self._total_steps())
        if self.config.scheduler_type == "linear":
            return get_linear_schedule_with_warmup(self.opt, warmup, total)
        if self.config.scheduler_type == "cosine":
            return get_cosine_schedule_with_warmup(
                self.opt, warmup, total, num_cycles=self.config.scheduler_num_cosine_cycles
            )
        raise ValueError(f"unknown scheduler_type {self.config.scheduler_type!r}")

    def _total_steps(self) -> int:
        total = self.config.num_epochs * len(self.train_loader)
        if self.config.max_steps is not None:
            total = min(total, self.config.max_steps)
        return max(total, 1)

    # -- progress ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's progress (what `training_state.json` holds)."""
        return dataclasses.asdict(self.state)

    @property
    def _metrics_path(self) -> Path:
        return Path(self.config.save_path) / METRICS_FILE

    @property
    def _unconfirmed_marker(self) -> Path:
        return Path(self.config.save_path) / UNCONFIRMED_RUN_FILE

    def _start_metrics_file(self) -> bool:
        """A run from scratch starts its own metrics log; an earlier run's lines go to `.prev`
        until this run's first checkpoint replaces the earlier run (`UNCONFIRMED_RUN_FILE`).
        A `.prev` from before that goes: this run's log starts empty. Rank 0; True if moved."""
        if self.rank != 0:
            return False
        path = self._metrics_path
        moved = path.is_file()
        if moved:
            path.replace(path.with_name(f"{path.name}.prev"))
            root_logger.info("the earlier run's %s moved to %s.prev", METRICS_FILE, METRICS_FILE)
        if self._earlier_run:  # after the move: a marker means it happened
            self._unconfirmed_marker.touch()
        return moved

    def _restore_earlier_metrics(self) -> None:
        """Undo `_start_metrics_file` for a run from scratch that ends before its first
        checkpoint: the earlier run's metrics come back, this run's lines go to `.prev`."""
        if self.rank != 0:
            return
        path = self._metrics_path
        previous = path.with_name(f"{path.name}.prev")
        if path.is_file():
            temporary = path.with_name(f".{path.name}.swap")
            path.replace(temporary)
            if previous.is_file():
                previous.replace(path)
            temporary.replace(previous)
        elif previous.is_file():  # this run logged nothing: only the earlier lines to put back
            previous.replace(path)
        self._unconfirmed_marker.unlink(missing_ok=True)

    def _log(self, metrics: dict[str, Any]) -> None:
        metric_logger.info(metrics, extra={"step": self.state.global_step})

    def _truncate_metrics_file(self) -> None:
        """Drop metric lines the interrupted run wrote after the checkpoint we resume from."""
        path = self._metrics_path
        if self.rank != 0 or not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by the crash
            step = entry.get("step")
            # Train lines of steps >= g and validation lines after g were not kept by the
            # checkpoint at global step g: the resumed run writes them again.
            limit = self.state.global_step if "train" in entry else self.state.global_step + 1
            if step is None or step < limit:
                kept.append(line)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text("".join(f"{line}\n" for line in kept))
        temporary.replace(path)

    # -- one step ------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        if "input_ids" not in batch:
            return self._empty_row()
        return {
            key: batch[key].to(self.device, non_blocking=True)
            for key in MODEL_INPUTS
            if key in batch
        }

    def _to_device(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Each row's model inputs on the device; on CUDA the copy of row n + 1 runs on a side
        stream while row n trains (the loader pins its rows, so the copy is asynchronous)."""
        if self.device.type != "cuda":
            yield from batches
            return
        stream = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)

        def send(batch: Any) -> tuple[Any, torch.cuda.Event | None]:
            if not isinstance(batch, dict) or "input_ids" not in batch:
                return batch, None
            stream.wait_stream(main)  # the row's memory may be reused from freed earlier rows
            with torch.cuda.stream(stream):
                moved = dict(batch)
                for key in MODEL_INPUTS:
                    if key in batch:
                        moved[key] = batch[key].to(self.device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            return moved, ready

        def receive(sent: tuple[Any, torch.cuda.Event | None]) -> Any:
            batch, ready = sent
            if ready is not None:
                main.wait_event(ready)
                for key in MODEL_INPUTS:
                    if key in batch:
                        batch[key].record_stream(main)
            return batch

        upcoming = None
        for batch in batches:
            current, upcoming = upcoming, send(batch)
            if current is not None:
                yield receive(current)
        if upcoming is not None:
            yield receive(upcoming)

    def _empty_row(self) -> dict[str, torch.Tensor]:
        """A one-token row with nothing to learn, for a step whose samples were all unusable."""
        config = getattr(self.model, "config", None)
        layer = getattr(config, "transformer_layer_config", None)
        hidden = getattr(config, "target_hidden_size", None) or getattr(layer, "hidden_size", None)
        fused = getattr(getattr(self.model, "fc", None), "in_features", None)
        if hidden is None or fused is None:
            raise ValueError("every sample of a packed row was unusable")
        zeros = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        return {
            "input_ids": zeros,
            "hidden_states": torch.zeros(1, 1, fused, device=self.device),
            "verifier_last_hidden_states": torch.zeros(1, 1, hidden, device=self.device),
            "loss_mask": zeros,
            "position_ids": zeros + 1,
            "lengths": torch.ones(1, dtype=torch.long, device=self.device),
        }

    def _reduce(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Average metrics over ranks (one collective) and bring them to Python floats."""
        if not metrics:
            return {}
        names = sorted(metrics)
        values = torch.stack([metrics[name].detach().float().reshape(()) for name in names])
        if self.is_distributed:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= self.world_size
        return dict(zip(names, values.tolist(), strict=True))

    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """Forward, backward, clip, optimizer and scheduler step on one packed row."""
        inputs = self._model_inputs(batch)
        self.opt.zero_grad(set_to_none=True)
        with self._autocast():
            loss, metrics = _unpack_output(self.wrapped(**inputs, **self.config.train_call_kwargs))
        if self.is_distributed:
            loss = loss * self._share_of_ranks_with_rows("input_ids" in batch)
        loss.backward()
        lr = self.opt.param_groups[0]["lr"]
        grad_norm = clip_and_step(self.opt, self.trainable_parameters(), self.config.max_grad_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        tokens = inputs["lengths"].sum().to(torch.float32) * ("input_ids" in batch)  # 0: empty row
        skipped = batch.get("skipped_samples", torch.zeros(())).to(self.device, torch.float32)
        reduced = self._reduce(
            {**metrics, "grad_norm": grad_norm.to(self.device).float(), "tokens": tokens,
             "skipped_samples": skipped}
        )
        reduced["tokens"] *= self.world_size
        reduced["skipped_samples"] *= self.world_size
        reduced["lr"] = lr
        if not math.isfinite(reduced["grad_norm"]):
            root_logger.warning(
                "step %d: NaN or inf in the loss or its gradients; this update was skipped "
                "(weights and optimizer state unchanged)", self.state.global_step,
            )
        return reduced

    def _share_of_ranks_with_rows(self, has_row: bool) -> torch.Tensor:
        """world size / the ranks whose row this step holds samples. The ranks' gradients are
        averaged; a rank whose row was empty (all its samples unusable) adds zeros, which would
        scale everyone's step down. One scalar collective, no host read."""
        # A fill on the device: torch.tensor(..., device=cuda) copies from the host and waits.
        present = torch.full((1,), 1.0 if has_row else 0.0, device=self._collective_device())
        dist.all_reduce(present, op=dist.ReduceOp.SUM)
        return (self.world_size / present.clamp(min=1.0)).to(self.device).reshape(())

    def _stop_flag(self) -> bool:
        """Whether any rank received SIGTERM or Ctrl-C (all ranks agree on the step to stop at)."""
        if not self.is_distributed:
            return self._stop_requested
        flag = torch.tensor([1.0 if self._stop_requested else 0.0], device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # -- epochs --------------------------------------------------------------------------------
    def _epoch_batches(self, loader: DataLoader, epoch: int, start_step: int) -> Iterator[Any]:
        sampler = loader.batch_sampler
        if hasattr(sampler, "set_epoch"):
            try:
                sampler.set_epoch(epoch, start_step)
            except TypeError:  # a 0.3.0-style sampler without positions
                if start_step:
                    raise ValueError("this batch sampler cannot start inside an epoch") from None
                sampler.set_epoch(epoch)
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        return iter(loader)

    def train_epoch(self, epoch: int, *, start_step: int = 0) -> bool:
        """Train one epoch from `start_step`; False when stopped early (max_steps)."""
        self.wrapped.train()
        batches = self._to_device(self._epoch_batches(self.train_loader, epoch, start_step))
        steps = len(self.train_loader)  # the plan of this epoch (packing varies per epoch)
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)  # after the loader drew its worker seeds
            self._pending_rng = None
        every = None
        if self.config.checkpoint_freq:
            every = max(1, round(self.config.checkpoint_freq * steps))
        progress = tqdm(
            total=steps, initial=start_step, desc=f"epoch {epoch + 1}/{self.config.num_epochs}",
            disable=not self.config.show_progress or self.rank != 0, dynamic_ncols=True,
        )
        started, tokens = time.perf_counter(), 0.0
        last_end = started
        self.state.epoch, self.state.epoch_complete = epoch, False
        self.state.step_in_epoch = start_step
        try:
            for step in range(start_step, steps):
                try:
                    batch = next(batches)
                except DataSourceError as error:
                    path = self._save_mid_epoch()
                    raise TrainingInterrupted(
                        f"{error}; checkpoint {path} at step {self.state.global_step}; "
                        "run the same command again to resume"
                    ) from error
                metrics = self.train_step(batch)
                # A float averaged over ranks and multiplied back: 5 on 3 ranks is 4.9999998.
                self.state.skipped_samples += round(metrics.pop("skipped_samples"))
                tokens += metrics["tokens"]
                # Wall-clock seconds since the previous step ended, waiting for data included
                # (train_step returns after its metrics reached the host: the step is done).
                now = time.perf_counter()
                metrics["step_seconds"], last_end = now - last_end, now
                if self.device.type == "cuda":
                    metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                lr = metrics.pop("lr")
                self._log({"train": metrics, "epoch": epoch, "lr": lr})  # step counts from 0
                self.state.step_in_epoch = step + 1
                self.state.global_step += 1
                rate = tokens / max(time.perf_counter() - started, 1e-9)
                source = getattr(self.train_loader, "progress_fields", None)  # online: both sides
                progress.set_postfix(
                    loss=f"{metrics.get('loss', float('nan')):.3f}",
                    acc=f"{metrics.get('full_acc_0', float('nan')):.3f}",
                    tok_s=f"{rate:,.0f}",
                    **(source() if source is not None else {}),
                )
                progress.update(1)
                last = step + 1 == steps
                if self._stop_flag():
                    path = self._save_mid_epoch()
                    raise TrainingInterrupted(
                        f"stopped by {self._stop_reason} at step {self.state.global_step}; checkpoint {path}; "
                        "run the same command again to resume"
                    )
                if self.config.max_steps is not None and self.state.global_step >= self.config.max_steps:
                    if not last:
                        self._save_mid_epoch()
                        return False
                if every and not last and (step + 1) % every == 0:
                    self._save_mid_epoch()
        finally:
            progress.close()
        return True

    @torch.no_grad()
    def val_epoch(self, epoch: int) -> dict[str, float] | None:
        """Mean validation metrics over the validation rows (and tau_sim), logged as `val`."""
        if self.val_loader is None:
            return None
        self.wrapped.eval()
        totals: dict[str, float] = {}
        for batch in tqdm(
            self._epoch_batches(self.val_loader, epoch, 0), total=len(self.val_loader),
            desc="validation", disable=not self.config.show_progress or self.rank != 0,
            dynamic_ncols=True,
        ):
            with self._autocast():
                _, metrics = _unpack_output(
                    self.wrapped(**self._model_inputs(batch), **self.config.val_call_kwargs)
                )
            # An empty row (all its samples unusable) runs to keep the ranks in step but weighs 0.
            weight = 1.0 if "input_ids" in batch else 0.0
            weighted = {name: value * weight for name, value in metrics.items()}
            weighted["__rows__"] = torch.tensor(weight, device=self.device)
            for name, value in self._reduce(weighted).items():
                totals[name] = totals.get(name, 0.0) + value
        rows = totals.pop("__rows__", 0.0)
        if rows == 0:
            return None
        means = {f"{name}_epoch": value / rows for name, value in totals.items()}
        score = tau_sim({name: value / rows for name, value in totals.items()})
        if score is not None:
            means["tau_sim"] = score
        self._log({"val": means, "epoch": epoch})
        return means

    # -- checkpoints ---------------------------------------------------------------------------
    def _remove_earlier_run(self) -> None:
        """Delete the checkpoints (and `best` link) of the run this from-scratch run replaces.

        Done right before this run's first checkpoint is written: a run stopped before that
        leaves the earlier one intact, and after it resume and pruning see only this run. Newest
        first, so an interrupted removal leaves a (shorter) earlier run, never a mix.
        """
        earlier, self._earlier_run = self._earlier_run, []
        self.checkpointer.remove([ref.name for ref in reversed(earlier)])
        root_logger.info("removed the %d checkpoints of the earlier run", len(earlier))

    def _save(self, name: str) -> Path:
        self._wrote_checkpoint = True  # from here on the earlier run is gone
        if self._earlier_run:
            self._remove_earlier_run()
        started = time.perf_counter()
        path = self.checkpointer.save(
            name, self.wrapped, self.opt, self.scheduler, self.state,
            float_dtype=self.config.checkpoint_dtype,
            optimizer_dtype=self.config.optimizer_state_dtype,
        )
        root_logger.info("checkpoint %s written in %.2f s", path, time.perf_counter() - started)
        if self.rank == 0:
            self._unconfirmed_marker.unlink(missing_ok=True)
        self._prune(path.name)
        return path

    def _save_mid_epoch(self) -> Path:
        return self._save(f"{self.state.epoch}-step{self.state.global_step}")

    def _prune(self, just_saved: str) -> None:
        """Keep the newest `keep_mid_epoch_checkpoints` mid-epoch checkpoints, and `just_saved`."""
        refs = self.checkpointer.checkpoints
        newest_epoch = max(
            (ref.sort_key() for ref in refs if ref.state.epoch_complete), default=(-1, 0)
        )
        recent = [
            ref.name for ref in refs if not ref.state.epoch_complete and ref.sort_key() > newest_epoch
        ]
        count = self.config.keep_mid_epoch_checkpoints
        keep = set(recent[-count:]) if count > 0 else set()
        self.checkpointer.prune(keep | {just_saved})

    def save_checkpoint(self, epoch: int) -> Path:
        """The end-of-epoch checkpoint `<save>/<epoch>` (0.3.0's name)."""
        self.state.epoch, self.state.epoch_complete = epoch, True
        self.state.step_in_epoch = len(self.train_loader)
        return self._save(str(epoch))

    # -- the run -------------------------------------------------------------------------------
    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM or a first Ctrl-C: finish the step, write a checkpoint, stop. A second Ctrl-C
        meets Python's own handler again and stops at once (KeyboardInterrupt), without one.
        Loader processes forked from this one inherit the handler; there it does nothing (the
        terminal's Ctrl-C reaches them too): this process stops them when it is done."""
        if os.getpid() != self._handler_pid:
            return
        name = "SIGTERM"
        hint = ""
        if signum == signal.SIGINT:
            name, hint = "Ctrl-C", " (Ctrl-C again stops at once, without one)"
            signal.signal(signal.SIGINT, signal.default_int_handler)
        root_logger.warning("%s: finishing this step, then writing a checkpoint%s", name, hint)
        self._stop_requested, self._stop_reason = True, name

    def _install_stop_handlers(self) -> dict[int, Any]:
        """SIGTERM, and Ctrl-C where Python's default handler has it (not where the shell made
        the process ignore it); the handlers replaced, to put back."""
        replaced: dict[int, Any] = {}
        if not self.config.handle_sigterm:
            return replaced
        self._handler_pid = os.getpid()
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            replaced[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_stop_signal)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                replaced[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_stop_signal)
        return replaced

    def run_training(self) -> TrainingState:
        """Train to the end (or `max_steps`); returns the final progress."""
        self._pending_rng = None
        moved_metrics = False
        if self.resume_ref is None:
            moved_metrics = self._start_metrics_file()
        else:
            self._truncate_metrics_file()
            if not self.resume_ref.legacy:
                self._pending_rng = self.checkpointer.load_rng_state(self.resume_ref.path)
        replaced = self._install_stop_handlers()
        try:
            start_epoch, start_step = self.state.resume_position()
            if self.config.max_steps is not None and self.state.global_step >= self.config.max_steps:
                return self.state
            for epoch in range(start_epoch, self.config.num_epochs):
                root_logger.info("epoch %d/%d", epoch + 1, self.config.num_epochs)
                finished = self.train_epoch(epoch, start_step=start_step if epoch == start_epoch else 0)
                if not finished:
                    break
                try:
                    validation = self.val_epoch(epoch)
                except DataSourceError as error:  # online: the engine died while validating
                    path = self._save_mid_epoch()  # the epoch's steps are done; resume validates
                    raise TrainingInterrupted(
                        f"{error}; checkpoint {path} at step {self.state.global_step}; "
                        "run the same command again to resume"
                    ) from error
                score = validation.get("tau_sim") if validation else None
                self.state.val_tau_sim = score
                improved = score is not None and (
                    self.state.best_val_tau_sim is None or score > self.state.best_val_tau_sim
                )
                if improved:
                    self.state.best_val_tau_sim, self.state.best_checkpoint = score, str(epoch)
                path = self.save_checkpoint(epoch)
                if improved:
                    self.checkpointer.point_best(str(epoch))
                if self.config.max_steps is not None and self.state.global_step >= self.config.max_steps:
                    break
        except BaseException:
            if moved_metrics and not self._wrote_checkpoint:
                # Stopped before its first checkpoint, this run leaves the earlier one as it
                # was: its metrics come back (and this run's lines go to `.prev`).
                self._restore_earlier_metrics()
            raise
        finally:
            for signum, handler in replaced.items():
                signal.signal(signum, handler)
        return self.state

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        return self.state.resume_position()[0]

