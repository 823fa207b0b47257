"""The optimizer step with gradient clipping, as one pass over the gradients where torch allows.

`torch.nn.utils.clip_grad_norm_` reads every gradient for the norm and then reads and writes
every gradient again to scale it. Torch's fused Adam/AdamW kernels can divide each gradient by a
`grad_scale` tensor as they read it (the hook `torch.amp.GradScaler` uses to unscale), so with a
fused optimizer the clip costs the norm alone: on a GPU that is most of a millisecond a step at
8B-draft shapes. Other optimizers get the plain clip followed by their step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["clip_and_step", "folds_clip_into_step"]

# clip_grad_norm_'s guard against a zero norm; the folded path divides by the same quantity.
_NORM_EPS = 1e-6


def folds_clip_into_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `clip_and_step` can hand the clip to `optimizer`'s fused kernel."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        group.get("fused") for group in optimizer.param_groups
    )


def clip_and_step(
    optimizer: torch.optim.Optimizer, parameters: Iterable[torch.nn.Parameter], max_norm: float
) -> torch.Tensor:
    """Clip the gradients of `parameters` to total 2-norm `max_norm`, step `optimizer`, and
    return the norm before clipping (a full tensor also when the gradients are DTensors).

    The same update as `clip_grad_norm_(parameters, max_norm)` then `optimizer.step()`, up to
    the rounding of a division instead of a multiplication when the clip is folded. A step whose
    gradients hold a NaN or inf (the norm is not finite) changes nothing: neither the weights
    nor the optimizer state, which one such step would otherwise turn into NaN for good. The
    caller sees it in the returned norm.
    """
    parameters = [parameter for parameter in parameters if parameter.grad is not None]
    if not folds_clip_into_step(optimizer):
        norm = _full(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        if bool(torch.isfinite(norm)):  # a host read: only unfused optimizers (CPU runs) take it
            optimizer.step()
        return norm
    norm = _full(torch.nn.utils.get_total_norm([parameter.grad for parameter in parameters]))
    # The fused kernel reads grad / grad_scale: at most `max_norm` in total, never scaled up.
    scale = torch.clamp((norm.float() + _NORM_EPS) / max_norm, min=1.0)
    optimizer.grad_scale = scale  # type: ignore[attr-defined]
    # ... and skips the whole update, step counts included, where found_inf is 1 (GradScaler's
    # hook): no host read.
    optimizer.found_inf = (~torch.isfinite(norm)).float()  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        # A later plain `step()` must not divide by a stale scale or skip on a stale flag.
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = None  # type: ignore[attr-defined]
    return norm


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The norm as a plain tensor (under FSDP2 it is a DTensor of partial sums)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
