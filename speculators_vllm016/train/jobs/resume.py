"""Resuming a run: the progress it continues from, reconciled with the run being started.

A checkpoint records what exact resume depends on besides weights and optimizer: the number of
processes, the seed, a digest of the training files and `--deterministic`. A resumed run that
differs in one of them still continues (the user may mean it), with a warning saying what will
not match an uninterrupted run, and records its own values from then on.

The optimizer and schedule settings (`--lr`, `--weight-decay`, `--max-grad-norm`, the
`--scheduler-*` flags and what they resolve to) are the resumed run's own too: a changed one is
applied from the resumed step on, with one warning naming each change old -> new
(`apply_resumed_settings`), so that `train_config.yaml` (which holds the new values) describes
the steps trained after it; the checkpoint records the settings its steps used.

What shapes the draft (`--num-layers`, `--norm-before-residual`, the draft vocabulary, the fused
layers) and what it attends to (`--sliding-window`: the draft is rebuilt from the flags, so a
flag left out would silently drop the checkpoint's window) cannot change on resume: the checkpoint's weights are that draft. A run started with
other values is refused before anything is written (`check_resumed_draft`), naming each flag
and the checkpoint's value, so `train_config.yaml` never describes a draft the run did not train.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

from speculators_vllm016.train.checkpointer import CheckpointRef, TrainingState
from speculators_vllm016.train.data import Eagle3SampleFileDataset
from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.train.loading.loader_contract import TrainingLoader

__all__ = [
    "apply_resumed_settings",
    "check_resumed_draft",
    "optimizer_settings",
    "reconcile_resumed_state",
    "training_data_digest",
]

# The flag of each recorded optimizer / schedule setting, for the warning that names a change.
SETTING_FLAGS = {
    "lr": "--lr",
    "weight_decay": "--weight-decay",
    "max_grad_norm": "--max-grad-norm",
    "scheduler_type": "--scheduler-type",
    "warmup_steps": "--scheduler-warmup-steps",
    "total_steps": "--scheduler-total-steps",
    "num_cosine_cycles": "--scheduler-num-cosine-cycles",
}

logger = logging.getLogger("speculators")


def training_data_digest(loader: TrainingLoader) -> str | None:
    """A hash of the training files' names and token counts, in order (the sampler's plans
    depend on them); None when the loader's dataset is not a list of sample files."""
    dataset = loader.dataset
    if not isinstance(dataset, Eagle3SampleFileDataset):
        return None
    digest = hashlib.sha256()
    for path, length in zip(dataset.data, dataset.lengths, strict=True):
        digest.update(f"{Path(path).name}\t{int(length)}\n".encode())
    return digest.hexdigest()[:16]


def reconcile_resumed_state(
    checkpoint: CheckpointRef,
    *,
    steps_per_epoch: int,
    world_size: int,
    seed: int,
    data_digest: str | None,
    deterministic: bool,
) -> TrainingState:
    """The progress to continue from `checkpoint`, with this run's settings recorded."""
    state = dataclasses.replace(checkpoint.state)
    if checkpoint.legacy:
        # 0.3.0 kept no step counter: the end of epoch e is (e + 1) epochs of steps.
        state.global_step = (checkpoint.state.epoch + 1) * steps_per_epoch
    if state.world_size != world_size:
        logger.warning(
            "checkpoint written with %d processes, resuming with %d: the batches of the rest "
            "of the run differ from an uninterrupted one",
            state.world_size,
            world_size,
        )
        state.world_size = world_size
    if not checkpoint.legacy and state.seed != seed:
        logger.warning(
            "checkpoint written with --seed %d, resuming with --seed %d: the batches and noise "
            "of the rest of the run differ from an uninterrupted one",
            state.seed,
            seed,
        )
    state.seed = seed  # the seed the rest of the run uses
    if (
        state.data_digest is not None
        and data_digest is not None
        and state.data_digest != data_digest
    ):
        logger.warning(
            "checkpoint written for other training data (sample files added, removed or "
            "changed length): the batches of the rest of the run differ from an "
            "uninterrupted one"
        )
    state.data_digest = data_digest
    recorded = state.deterministic
    if recorded is not None and recorded != deterministic:
        logger.warning(
            "checkpoint written %s --deterministic, resuming %s it: on a GPU the rest of the "
            "run does not end bit for bit where an uninterrupted one would",
            "with" if recorded else "without",
            "without" if recorded else "with",
        )
    state.deterministic = deterministic
    return state


def optimizer_settings(
    *,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    scheduler_type: str,
    warmup_steps: int,
    total_steps: int,
    num_cosine_cycles: float,
) -> dict[str, Any]:
    """The settings a run's steps use (the schedule's steps resolved), as a checkpoint records
    them in `TrainingState.optimizer`."""
    return {
        "lr": float(lr),
        "weight_decay": float(weight_decay),
        "max_grad_norm": float(max_grad_norm),
        "scheduler_type": scheduler_type,
        "warmup_steps": int(warmup_steps),
        "total_steps": int(total_steps),
        "num_cosine_cycles": float(num_cosine_cycles),
    }


def _loaded_settings(optimizer: Any, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """What the checkpoint's steps used: its record, else (older checkpoints) what the loaded
    optimizer state itself holds (the peak rate, the weight decay)."""
    if recorded is not None:
        return dict(recorded)
    group = optimizer.param_groups[0]
    return {
        "lr": float(group.get("initial_lr", group["lr"])),
        "weight_decay": float(group["weight_decay"]),
    }


def apply_resumed_settings(
    optimizer: Any,
    scheduler: Any,
    recorded: dict[str, Any] | None,
    current: dict[str, Any],
    step: int,
) -> None:
    """After the optimizer and scheduler states are loaded (they bring the checkpoint's rate and
    weight decay back), put this run's `current` settings in force, warning once about any that
    changed. The schedule's shape comes from this run's flags already; its peak rate and the
    weight decay are set here."""
    before = _loaded_settings(optimizer, recorded)
    changes = [
        f"{SETTING_FLAGS[name]} {before[name]:g} -> {value:g}"
        if isinstance(value, float)
        else f"{SETTING_FLAGS[name]} {before[name]} -> {value}"
        for name, value in current.items()
        if name in before and before[name] != value
    ]
    if changes:
        logger.warning(
            "resuming with other optimizer settings than the checkpoint's, in force from step %d "
            "on (train_config.yaml holds the new ones): %s",
            step,
            ", ".join(changes),
        )
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = current["lr"], current["weight_decay"]
        group["lr"] = current["lr"]
    if scheduler is not None:
        scheduler.base_lrs = [current["lr"]] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = current["lr"] * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def check_resumed_draft(
    checkpoint: Path,
    *,
    num_layers: int,
    norm_before_residual: bool,
    draft_vocab: int,
    aux_ids: list[int] | None,
    sliding_window: int | None = None,
) -> None:
    """The run's draft settings against the checkpoint it resumes (`checkpoint`'s config.json):
    any difference refused in one line naming the flags, the checkpoint's values and the two
    ways on (the checkpoint's values, or a new run)."""
    import json

    try:
        recorded = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return  # an unreadable config fails the load itself, with its own message
    layer = recorded.get("transformer_layer_config") or {}
    differences = []
    if "num_hidden_layers" in layer and int(layer["num_hidden_layers"]) != num_layers:
        differences.append(f"--num-layers {num_layers} (checkpoint: {layer['num_hidden_layers']})")
    if (
        "norm_before_residual" in recorded
        and bool(recorded["norm_before_residual"]) != norm_before_residual
    ):
        flag = "--norm-before-residual" if norm_before_residual else "--no-norm-before-residual"
        differences.append(f"{flag} (checkpoint: {recorded['norm_before_residual']})")
    if "draft_vocab_size" in recorded and int(recorded["draft_vocab_size"]) != draft_vocab:
        differences.append(
            f"a draft vocabulary of {draft_vocab} (--draft-vocab-size / --d2t-path; "
            f"checkpoint: {recorded['draft_vocab_size']})"
        )
    ids = recorded.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and aux_ids is not None and list(ids) != list(aux_ids):
        differences.append(f"fused layers {aux_ids} (--layer-ids; checkpoint: {ids})")
    window = _recorded_window(layer)
    if window != sliding_window:
        given = (
            "no --sliding-window"
            if sliding_window is None
            else f"--sliding-window {sliding_window}"
        )
        differences.append(f"{given} (checkpoint: {window or 'full attention'})")
    if differences:
        raise TrainSetupError(
            f"--save-path {checkpoint.parent} resumes checkpoint {checkpoint.name}, whose draft "
            f"differs: {'; '.join(differences)}; a resumed run cannot change the draft: give the "
            "checkpoint's values, or a new --save-path (or --no-resume-from-checkpoint) for a new run"
        )


def _recorded_window(layer: dict[str, Any]) -> int | None:
    """The sliding window a checkpoint's layer config records (None: full attention, or a config
    the load itself refuses with its own message)."""
    from types import SimpleNamespace

    from speculators_vllm016.models.eagle3.config import sliding_window_of
    from speculators_vllm016.utils.errors import InvalidInputError

    try:
        return sliding_window_of(SimpleNamespace(**layer))  # type: ignore[arg-type]
    except InvalidInputError:
        return None
