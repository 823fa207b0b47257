"""The learning-rate schedule: linear or cosine decay after a warm-up, or a constant rate."""

from __future__ import annotations

from typing import Literal

import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["build_lr_scheduler", "default_warmup_steps"]


def default_warmup_steps(run_steps: int) -> int:
    """1% of the steps this run trains (0.3.0's default, which ignored a step cap)."""
    return run_steps // 100


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: Literal["linear", "cosine", "none"],
    *,
    run_steps: int,
    warmup_steps: int | None = None,
    total_steps: int | None = None,
    num_cosine_cycles: float = 0.5,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The schedule over `total_steps` (default: `run_steps`, the steps this run trains) with
    `warmup_steps` (default: `default_warmup_steps(run_steps)`); None for `kind="none"`."""
    if kind == "none":
        return None
    total = total_steps or run_steps
    warmup = default_warmup_steps(run_steps) if warmup_steps is None else warmup_steps
    if kind == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer, warmup, total, num_cycles=num_cosine_cycles
        )
    raise InvalidInputError(f"unknown scheduler_type {kind!r}")
