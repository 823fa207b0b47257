"""Training checkpoints: 0.3.0's folder layout, written whole or not at all, resumable exactly.

Layout under the save path (0.3.0's, extended):

    <save>/<epoch>/                 end of an epoch (0.3.0's names)
    <save>/<epoch>-step<global>/    inside an epoch (`--checkpoint-freq`, SIGTERM)
        config.json, model.safetensors    the draft, in the checkpoint dtype (bf16): what vLLM serves
        master_weights.safetensors        trainable weights in their training dtype, when it differs
        optimizer_state_dict.pt           full optimizer state, keyed by parameter name, fp32
        scheduler_state_dict.pt
        rng_state_rank<r>.pt              python, numpy, torch and CUDA RNG states of each rank
        training_state.json               epoch, step in epoch, global step, sampler; written last
    <save>/best -> <name>                 the checkpoint with the highest validation tau_sim

A checkpoint is assembled in a hidden temporary folder and renamed into place, so a crash leaves
no half-written checkpoint under a real name. Resume takes the newest complete checkpoint; a folder
of 0.3.0's layout (no training_state.json) counts as the end of its epoch.

Retention (`checkpointing.retention`, mixed in): `apply_retention` keeps the newest
`keep_mid_epoch` mid-epoch checkpoints after the newest epoch one and, with `keep_last`, the
newest `keep_last` checkpoints of any kind (and the best); a run from scratch over an earlier
run's checkpoints (`replace_earlier_run`) deletes them right before its own first save (which the
trainer makes only at the end of that run's first epoch, or at its last step if sooner).

With `background=True`, `save` takes a snapshot and returns; the files are written by a thread
(`checkpointing.background_writer`), into the same temporary folder, renamed in the same way.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers.modeling_utils import PreTrainedModel

from speculators_vllm016.train.checkpointing.background_writer import (
    CheckpointWriter,
    Staged,
    stage,
    to_host,
)
from speculators_vllm016.train.checkpointing.checkpoint_files import (
    convert_float_dtype,
    fsync_files,
    is_disk_full,
    load_safetensors_state_dict,
    reading,
)
from speculators_vllm016.train.checkpointing.named_optimizer_state import (
    load_named_optimizer_state,
    named_optimizer_state,
)
from speculators_vllm016.train.checkpointing.retention import (
    TEMP_PREFIX,
    CheckpointRetention,
)
from speculators_vllm016.train.checkpointing.rng_state import (
    RngStateUnsafe,
    capture_rng_state,
)
from speculators_vllm016.train.checkpointing.rng_state import load_rng_state as read_rng_state
from speculators_vllm016.train.errors import CheckpointReadError, CheckpointWriteError
from speculators_vllm016.utils.atomic_files import (
    TEMP_SUFFIX,
    atomic_torch_save,
    give_usual_modes,
    replace_folder,
    restore_replaced_folder,
    torch_save,
)
from speculators_vllm016.utils.errors import InvalidInputError, type_and_first_line

__all__ = [
    "BaseCheckpointer",
    "CheckpointRef",
    "DistributedCheckpointer",
    "SingleGPUCheckpointer",
    "TrainingState",
    "convert_float_dtype",
    "find_checkpoints",
    "load_safetensors_state_dict",
]

logger = logging.getLogger(__name__)

STATE_FILE = "training_state.json"
MASTER_WEIGHTS = "master_weights.safetensors"
# Checkpoint folders are assembled under `.tmp-<name>` (every rank derives the same name);
# single files written in the save folder use utils/atomic_files' `.<name>.<hex8>.tmp` (before
# it, `.<name>.tmp`: the sweep knows both).
_OLD_PREFIX = f"{TEMP_PREFIX}old-"  # a checkpoint moved aside while its replacement goes in
_TEMP_FILE = re.compile(rf"^\..+?(\.[0-9a-f]{{8}})?{re.escape(TEMP_SUFFIX)}$")


@dataclass
class TrainingState:
    """The run's progress: everything besides weights and optimizer that exact resume needs.

    `step_in_epoch` counts optimizer steps done in `epoch`; `epoch_complete` marks the end of it.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    epoch_complete: bool = False
    world_size: int = 1
    seed: int = 0
    val_tau_sim: float | None = None
    best_val_tau_sim: float | None = None
    best_checkpoint: str | None = None
    skipped_samples: int = 0
    """Samples of training rows dropped as unusable (NaN/inf, wrong widths, unreadable), each epoch."""
    unreadable_files: int = 0
    """Sample files left out when the data was listed (not even their header could be read)."""
    last_loss: float | None = None
    """The last training step's loss: the command's last line reports it."""
    # The training files' names and token counts, hashed: the sampler's plans depend on them.
    data_digest: str | None = None
    # `--deterministic` (None: a checkpoint from before it was recorded).
    deterministic: bool | None = None
    # The optimizer and schedule settings the steps so far used (`resume.optimizer_settings`);
    # None: a checkpoint from before they were recorded.
    optimizer: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def resume_position(self) -> tuple[int, int]:
        """(epoch, step in it) where training continues after this state."""
        if self.epoch_complete:
            return self.epoch + 1, 0
        return self.epoch, self.step_in_epoch

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        values = json.loads(text)
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in values.items() if key in known})


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint folder and the progress it records."""

    path: Path
    state: TrainingState
    legacy: bool  # 0.3.0 layout: no training state, no RNG states

    @property
    def name(self) -> str:
        return self.path.name

    def sort_key(self) -> tuple[int, int]:
        return self.state.resume_position()


def _is_complete(folder: Path) -> bool:
    if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
        return False
    return (folder / STATE_FILE).is_file() or (folder / "optimizer_state_dict.pt").is_file()


def find_checkpoints(save_path: str | os.PathLike) -> list[CheckpointRef]:
    """Complete checkpoints under `save_path`, oldest first."""
    root = Path(save_path)
    if not root.is_dir():
        return []
    found: list[CheckpointRef] = []
    for folder in root.iterdir():
        # A save killed after writing its last file but before the rename leaves a complete-looking
        # temporary folder; it was never a checkpoint (and the trainer removes it at start).
        if folder.name.startswith(TEMP_PREFIX):
            continue
        if folder.is_symlink() or not folder.is_dir() or not _is_complete(folder):
            continue
        state_file = folder / STATE_FILE
        if state_file.is_file():
            try:
                state = TrainingState.from_json(state_file.read_text())
            except (ValueError, TypeError, UnicodeDecodeError) as error:
                logger.warning(
                    "%s of checkpoint %s cannot be read (%s): that checkpoint is left out "
                    "(resume takes the one before it)",
                    STATE_FILE,
                    folder,
                    type_and_first_line(error),
                )
                continue
            found.append(CheckpointRef(folder, state, legacy=False))
        elif folder.name.isdigit():
            epoch = int(folder.name)
            state = TrainingState(epoch=epoch, epoch_complete=True, global_step=-1)
            found.append(CheckpointRef(folder, state, legacy=True))
    found.sort(key=CheckpointRef.sort_key)
    return found


def remove_temporary_folders(save_path: Path) -> None:
    """Delete what an interrupted save left behind (only this run's save path): checkpoint
    folders being assembled, and temporary files of an atomic write (the metrics log's). A
    checkpoint whose replacement was killed between its two renames is first put back under its
    name (the new one, never renamed in, goes with the leftovers)."""
    if save_path.is_dir():
        for entry in save_path.iterdir():
            if entry.name.startswith(_OLD_PREFIX) and entry.is_dir():
                restore_replaced_folder(save_path / entry.name[len(_OLD_PREFIX) :], entry)
        for entry in save_path.iterdir():
            if entry.name.startswith(TEMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif _TEMP_FILE.match(entry.name) and entry.is_file() and not entry.is_symlink():
                entry.unlink(missing_ok=True)


@dataclass
class _WriteJob:
    """What rank 0 writes of one checkpoint, taken in the step loop (`BaseCheckpointer.save`)."""

    name: str
    temporary: Path
    final: Path
    model: torch.nn.Module
    weights: Staged
    optimizer: Staged
    scheduler: dict[str, Any] | None
    state: TrainingState
    float_dtype: torch.dtype
    optimizer_dtype: torch.dtype | None
    then: Callable[[Path], None] | None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class BaseCheckpointer(CheckpointRetention):
    """Saves and finds checkpoints under `path` (see the module docstring for the layout).

    `previous_epoch` / `prev_path` are 0.3.0's: the newest completed epoch folder. `latest` is the
    newest complete checkpoint of any kind, which is what the trainer resumes from.
    """

    sharded: bool = False

    def __init__(
        self,
        path: Path | str,
        *,
        keep_mid_epoch: int | None = None,
        keep_last: int | None = None,
        background: bool = False,
    ) -> None:
        """`keep_mid_epoch`: how many mid-epoch checkpoints `apply_retention` keeps after the
        newest epoch one (None: it keeps them all); `keep_last`: how many checkpoints of any
        kind it keeps (None: all), the best one besides; `background`: `save` returns before
        the files are written (`background_writer`)."""
        if keep_mid_epoch is not None and keep_mid_epoch < 0:
            raise InvalidInputError(
                f"keep_mid_epoch_checkpoints must be >= 0, got {keep_mid_epoch}"
            )
        if keep_last is not None and keep_last < 1:
            raise InvalidInputError(f"keep_last must be at least 1, got {keep_last}")
        self.path = Path(path)
        self.keep_mid_epoch = keep_mid_epoch
        self.keep_last = keep_last
        self.writer = CheckpointWriter(background)
        # Checkpoints of an earlier run a from-scratch run found: removed at its first save.
        self.earlier_run: list[CheckpointRef] = []
        self.refresh()

    def refresh(self) -> None:
        self.checkpoints = find_checkpoints(self.path)
        epochs = [ref for ref in self.checkpoints if ref.state.epoch_complete]
        self.previous_epoch = max((ref.state.epoch for ref in epochs), default=-1)
        self.prev_path: Path | None = (
            self.path / str(self.previous_epoch) if self.previous_epoch != -1 else None
        )
        self.latest: CheckpointRef | None = self.checkpoints[-1] if self.checkpoints else None

    # -- paths (0.3.0) -----------------------------------------------------------------------
    def model_path(self, epoch: int | str) -> Path:
        return self.path / str(epoch) / "model.safetensors"

    def optimizer_path(self, epoch: int | str) -> Path:
        return self.path / str(epoch) / "optimizer_state_dict.pt"

    def scheduler_path(self, epoch: int | str) -> Path:
        return self.path / str(epoch) / "scheduler_state_dict.pt"

    def _source(self, checkpoint: Path | None) -> Path:
        source = checkpoint or (self.latest.path if self.latest else self.prev_path)
        if source is None:
            raise FileNotFoundError(f"no checkpoint under {self.path}")
        return Path(source)

    def _previous(self, checkpoint: Path) -> Path | None:
        """The complete checkpoint before `checkpoint` (what to resume from if it is damaged)."""
        paths = [ref.path for ref in self.checkpoints]
        if checkpoint not in paths:
            return paths[-1] if paths else None
        index = paths.index(checkpoint)
        return paths[index - 1] if index > 0 else None

    def _reading(self, path: Path) -> Any:
        """`checkpoint_files.reading` for a file of the checkpoint folder `path.parent`."""
        return reading(path, path.parent, self._previous(path.parent))

    # -- state gathering (collective where sharded) ------------------------------------------
    def _model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in _unwrap(model).state_dict().items()}

    def _optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return named_optimizer_state(_unwrap(model), optimizer)

    def _set_model_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        target = _unwrap(model)
        device = next(target.parameters()).device
        incompatible = target.load_state_dict(
            {k: v.to(device) for k, v in state.items()}, strict=False
        )
        if incompatible.unexpected_keys:
            raise InvalidInputError(
                f"checkpoint weights the model lacks: {incompatible.unexpected_keys[:5]}"
            )

    def _set_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        load_named_optimizer_state(_unwrap(model), optimizer, state)

    # -- 0.3.0 API ---------------------------------------------------------------------------
    def load_model_state_dict(
        self,
        model: PreTrainedModel,
        float_dtype: torch.dtype | None = None,
        *,
        checkpoint: Path | None = None,
    ) -> None:
        """Load weights: the master weights where the checkpoint has them, else model.safetensors.

        With master weights, only the trained weights are loaded: frozen ones (embeddings, the
        verifier's head) keep the exact values the model took from the verifier, instead of
        the rounded copies in the served file.
        """
        source = self._source(checkpoint)
        dtype = float_dtype or next(_unwrap(model).parameters()).dtype
        path = source / MASTER_WEIGHTS
        if not path.is_file():
            path = source / "model.safetensors"
        with self._reading(path):
            state = load_safetensors_state_dict(path, "cpu")
        self._set_model_state(model, convert_float_dtype(state, dtype))

    def load_optimizer_state_dict(
        self,
        model: PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        float_dtype: torch.dtype | None = None,
        *,
        checkpoint: Path | None = None,
    ) -> None:
        source = self._source(checkpoint)
        dtype = float_dtype or next(_unwrap(model).parameters()).dtype
        path = source / "optimizer_state_dict.pt"
        with self._reading(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
        state = convert_float_dtype(state, dtype)
        self._set_optimizer_state(model, optimizer, state)

    def load_scheduler_state_dict(
        self, scheduler: torch.optim.lr_scheduler.LRScheduler, *, checkpoint: Path | None = None
    ) -> None:
        path = self._source(checkpoint) / "scheduler_state_dict.pt"
        if path.is_file():
            with self._reading(path):
                state = torch.load(path, weights_only=True)
            scheduler.load_state_dict(state)

    def save_scheduler_state_dict(
        self, scheduler: torch.optim.lr_scheduler.LRScheduler, epoch: int
    ) -> None:
        """0.3.0's separate scheduler save into an existing epoch folder."""
        if self._rank() == 0:
            atomic_torch_save(scheduler.state_dict(), self.scheduler_path(epoch))

    @abstractmethod
    def save_checkpoint(
        self,
        model: PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        epoch: int,
        float_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """0.3.0's end-of-epoch save (model and optimizer) into `<path>/<epoch>`."""

    # -- the trainer's save ------------------------------------------------------------------
    def save(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        state: TrainingState,
        *,
        float_dtype: torch.dtype = torch.bfloat16,
        optimizer_dtype: torch.dtype | None = None,
        rng_state: dict[str, Any] | None = None,
        then: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint `name` atomically (every rank calls this; rank 0 writes the files).

        The weights, optimizer and scheduler state, RNG states and `state` are taken as they are
        now. With `background` (the constructor's), rank 0 writes the files in its writer thread
        after this returns, and `wait()` waits for them; `then(path)` runs once the checkpoint
        is in place (rank 0). `optimizer_dtype=None` keeps the optimizer state in its own dtype
        (0.3.0 cast it to bf16).
        """
        rank = self._rank()
        distributed = dist.is_available() and dist.is_initialized()
        if rank == 0:
            self.writer.wait()  # one write at a time; the one before may have failed
        if self.earlier_run:
            self._remove_earlier_run()
        staged_weights = staged_optimizer = None
        if self.sharded or rank == 0:  # the sharded gathers are collectives: every rank
            inner = _unwrap(model)
            skipped = set(getattr(inner, "_keys_to_ignore_on_save", None) or ())
            weights = {k: v for k, v in self._model_state(model).items() if k not in skipped}
            live, background = not self.sharded, self.writer.background
            staged_weights = stage(weights, live=live, background=background)
            staged_optimizer = stage(
                self._optimizer_state(model, optimizer), live=live, background=background
            )
        final = self.path / name
        temporary = self.path / f"{TEMP_PREFIX}{name}"
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
        if distributed:
            dist.barrier()
        try:
            torch_save(rng_state or capture_rng_state(), temporary / f"rng_state_rank{rank}.pt")
        except Exception as error:
            self._raise_if_disk_full(error, name, temporary)
            raise
        if distributed:
            dist.barrier()
        if rank == 0:
            job = _WriteJob(
                name=name,
                temporary=temporary,
                final=final,
                model=_unwrap(model),
                weights=staged_weights,
                optimizer=staged_optimizer,
                scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
                state=copy.deepcopy(state),
                float_dtype=float_dtype,
                optimizer_dtype=optimizer_dtype,
                then=then,
            )
            self.writer.start(name, lambda: self._finish(job))
        if distributed and not self.writer.background:
            dist.barrier()
        if rank != 0:
            self.refresh()
        return final

    def wait(self) -> None:
        """Wait until the checkpoint being written in the background is in place (rank 0);
        raises the error of a write that failed."""
        self.writer.wait()

    def _raise_if_disk_full(self, error: BaseException, name: str, temporary: Path) -> None:
        if not is_disk_full(error):
            return
        shutil.rmtree(temporary, ignore_errors=True)  # gives back the space it took
        resume = f"resume from {self.latest.path}" if self.latest else "start again"
        raise CheckpointWriteError(
            f"the disk is full writing checkpoint {name} in {self.path}; free space, then run "
            f"the same command again to {resume}"
        ) from error

    def _finish(self, job: _WriteJob) -> None:
        """Rank 0's part of a save: every file into the temporary folder, flushed, then the
        folder renamed into place (in the writer thread when writing in the background)."""
        started = time.perf_counter()
        try:
            self._write_files(job.temporary, job, to_host(job.weights), to_host(job.optimizer))
        except Exception as error:
            self._raise_if_disk_full(error, job.name, job.temporary)
            raise
        replace_folder(job.temporary, job.final, aside=self.path / f"{_OLD_PREFIX}{job.name}")
        self.refresh()
        logger.info("checkpoint %s written in %.2f s", job.final, time.perf_counter() - started)
        if job.then is not None:
            job.then(job.final)

    def _write_files(
        self,
        temporary: Path,
        job: _WriteJob,
        weights: dict[str, torch.Tensor],
        optimizer_state: dict,
    ) -> None:
        """Every rank-0 file of the checkpoint into `temporary` (`job.temporary`), flushed to
        disk (each rank's RNG state is there already); the training state last."""
        served = convert_float_dtype(weights, job.float_dtype)
        job.model.save_pretrained(temporary, state_dict=served, safe_serialization=True)
        trainable = {
            name: weights[name].contiguous()
            for name, parameter in job.model.named_parameters()
            if parameter.requires_grad and name in weights
        }
        if any(tensor.dtype != job.float_dtype for tensor in trainable.values()):
            save_file(trainable, str(temporary / MASTER_WEIGHTS))
        if job.optimizer_dtype is not None:
            optimizer_state = convert_float_dtype(optimizer_state, job.optimizer_dtype)
        torch_save(optimizer_state, temporary / "optimizer_state_dict.pt")
        if job.scheduler is not None:
            torch_save(job.scheduler, temporary / "scheduler_state_dict.pt")
        (temporary / STATE_FILE).write_text(job.state.to_json())
        give_usual_modes(temporary)  # safetensors writes 0600: a server may run as another user
        fsync_files(temporary)

    def load_rng_state(self, checkpoint: Path) -> dict[str, Any] | None:
        """This rank's RNG states in `checkpoint` (None without the file), read without running
        code from it (`rng_state`)."""
        path = checkpoint / f"rng_state_rank{self._rank()}.pt"
        if not path.is_file():
            return None
        try:
            with self._reading(path):
                return read_rng_state(path)
        except CheckpointReadError as error:
            if not isinstance(error.__cause__, RngStateUnsafe):
                raise
            raise CheckpointReadError(
                f"{path.name} of checkpoint {checkpoint} is not an RNG state this trainer writes: "
                f"loading it would run code from the file ({error.__cause__}), so it is refused; "
                f"delete that file to resume without the same random streams"
            ) from None


class SingleGPUCheckpointer(BaseCheckpointer):
    """Checkpoints of a model held whole by this process (one process, or DDP replicas)."""

    def save_checkpoint(
        self,
        model: PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        epoch: int,
        float_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        state = TrainingState(epoch=epoch, epoch_complete=True, global_step=-1)
        self.save(str(epoch), model, optimizer, None, state, float_dtype=float_dtype)
        self.wait()  # 0.3.0's save returns with the files written


class DistributedCheckpointer(SingleGPUCheckpointer):
    """Checkpoints of an FSDP2-sharded model: full state gathered to rank 0, loaded on every rank."""

    sharded = True

    def _model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)

    def _optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=options)

    def _set_model_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, state, options=options)

    def _set_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        if state["state"] and all(isinstance(key, int) for key in state["state"]):
            raise InvalidInputError(
                "this optimizer state is keyed by index (a single-process 0.3.0 checkpoint); "
                "resume it with one process first"
            )
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=True)
        )
