"""One optimizer step on one packed row: forward, backward, clip, optimizer and scheduler step,
and the step's metrics averaged over ranks.

`TrainStep` is the step the trainer runs (`Trainer.train_step`) and the one
`benchmarks/training.py` times, so the benchmark measures the trainer's own work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from speculators_vllm016.train.draft_contract import DraftCallOptions, loss_and_metrics
from speculators_vllm016.train.loading.device_rows import StepRow
from speculators_vllm016.train.metrics_log import tau_sim
from speculators_vllm016.train.optimizer_step import clip_and_step

__all__ = [
    "TrainStep",
    "autocast",
    "build_optimizer",
    "collective_device",
    "reduce_metrics",
    "validation_means",
]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`; nothing when `dtype` is None (fp32 training)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def collective_device(device: torch.device) -> torch.device:
    """Where a small collective's tensor lives: the GPU under NCCL, the CPU under gloo."""
    return device if device.type == "cuda" else torch.device("cpu")


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over the model's parameters (frozen ones get no gradient, hence no update)."""
    # Fused AdamW also takes FSDP2's sharded (DTensor) parameters: one kernel per group
    # of tensors instead of foreach's several, about 3 ms a step at 8B-draft shapes.
    return torch.optim.AdamW(
        list(model.named_parameters()),
        lr=lr,
        weight_decay=weight_decay,
        fused=(device.type == "cuda") or None,
    )


def reduce_metrics(
    metrics: dict[str, torch.Tensor], distributed: bool, world_size: int
) -> dict[str, float]:
    """Average metrics over ranks (one collective) and bring them to Python floats."""
    if not metrics:
        return {}
    names = sorted(metrics)
    values = torch.stack([metrics[name].detach().float().reshape(()) for name in names])
    if distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= world_size
    return dict(zip(names, values.tolist(), strict=True))


@dataclass
class TrainStep:
    """The parts one step uses; calling it on a `StepRow` runs the step.

    Returns the model's metrics averaged over ranks, `grad_norm`, `tokens`, `trained_tokens`
    (tokens with a loss: 0 for a row without samples) and `skipped_samples` summed over ranks,
    and `lr`, the learning rate the step used.
    """

    model: torch.nn.Module
    """What the step calls: the DDP wrapper, or the model itself (FSDP2 shards it in place)."""
    optimizer: torch.optim.Optimizer
    parameters: list[torch.nn.Parameter]
    """The trainable parameters: their gradients are clipped together."""
    device: torch.device
    max_grad_norm: float = 1.0
    call_options: DraftCallOptions = field(default_factory=DraftCallOptions)
    autocast_dtype: torch.dtype | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    distributed: bool = False
    world_size: int = 1

    def __call__(self, row: StepRow) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.autocast_dtype):
            loss, metrics = loss_and_metrics(self.model(**row.inputs, **self.call_options))
        if self.distributed:
            loss = loss * self._share_of_ranks_with_rows(row.has_samples)
        loss.backward()
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = clip_and_step(self.optimizer, self.parameters, self.max_grad_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        tokens = row.inputs["lengths"].sum().to(torch.float32) * row.has_samples  # 0: empty row
        mask = row.inputs.get("loss_mask")
        trained = tokens if mask is None else mask.sum().to(torch.float32) * row.has_samples
        skipped = row.skipped_samples.to(self.device, torch.float32)
        reduced = reduce_metrics(
            {
                **metrics,
                "grad_norm": grad_norm.to(self.device).float(),
                "tokens": tokens,
                "trained_tokens": trained,
                "skipped_samples": skipped,
            },
            self.distributed,
            self.world_size,
        )
        reduced["tokens"] *= self.world_size
        reduced["trained_tokens"] *= self.world_size
        reduced["skipped_samples"] *= self.world_size
        reduced["lr"] = lr
        return reduced

    def _share_of_ranks_with_rows(self, has_row: bool) -> torch.Tensor:
        """world size / the ranks whose row this step holds samples. The ranks' gradients are
        averaged; a rank whose row was empty (all its samples unusable) adds zeros, which would
        scale everyone's step down. One scalar collective, no host read."""
        # A fill on the device: torch.tensor(..., device=cuda) copies from the host and waits.
        present = torch.full((1,), 1.0 if has_row else 0.0, device=collective_device(self.device))
        dist.all_reduce(present, op=dist.ReduceOp.SUM)
        return (self.world_size / present.clamp(min=1.0)).to(self.device).reshape(())


@torch.no_grad()
def validation_means(
    model: torch.nn.Module,
    rows: Iterable[StepRow],
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    call_options: DraftCallOptions,
    world_size: int | None,
) -> dict[str, float] | None:
    """Every metric's mean over the rows as `<name>_epoch` (over all ranks when `world_size`
    is given), `tau_sim` of the accuracies and `skipped_samples`; None without a row that held
    samples. An empty row (all its samples unusable) runs to keep the ranks in step but weighs 0."""
    totals: dict[str, float] = {}
    for row in rows:
        with autocast(device, autocast_dtype):
            _, metrics = loss_and_metrics(model(**row.inputs, **call_options))
        weight = 1.0 if row.has_samples else 0.0
        weighted = {name: value * weight for name, value in metrics.items()}
        weighted["__rows__"] = torch.tensor(weight, device=device)
        weighted["__skipped__"] = row.skipped_samples.to(device, torch.float32)
        for name, value in reduce_metrics(
            weighted, world_size is not None, world_size or 1
        ).items():
            totals[name] = totals.get(name, 0.0) + value
    count = totals.pop("__rows__", 0.0)
    skipped = round(totals.pop("__skipped__", 0.0) * (world_size or 1))  # a mean over ranks
    if count == 0:
        return None
    means = {f"{name}_epoch": value / count for name, value in totals.items()}
    if skipped:
        means["skipped_samples"] = skipped
    score = tau_sim({name: value / count for name, value in totals.items()})
    if score is not None:
        means["tau_sim"] = score
    return means
