"""The reload-and-compare check of converted folders (EAGLE and EAGLE-3 alike).

A converter saves its folder, reloads it with the library's model class, places the loaded
tensors on the device the user asked to validate on, and compares every converted weight with
what it meant to write: a folder that does not reload equal is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["check_reloaded_weights", "loaded_on"]

logger = logging.getLogger(__name__)


def loaded_on(model: torch.nn.Module, device: str) -> dict[str, torch.Tensor]:
    """The model's loaded tensors placed on `device` (refused early if the device is unusable).

    Tensors left on the meta device (parts a checkpoint does not carry) are skipped.
    """
    try:
        target = torch.device(device)
        return {
            name: tensor.to(target)
            for name, tensor in model.state_dict().items()
            if not tensor.is_meta
        }
    except (RuntimeError, AssertionError) as err:
        raise InvalidInputError(f"cannot validate on --validate-device {device!r}: {err}") from err


def check_reloaded_weights(
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    device: str,
    checkpoint_path: str | Path,
    what: str = "converted checkpoint",
) -> None:
    """Refuse `model` (reloaded from `checkpoint_path`) unless, on `device`, it holds every
    tensor of `weights` unchanged; `what` names the folder in the error."""
    state = loaded_on(model, device)
    bad = [
        k
        for k, v in weights.items()
        if k not in state
        or state[k].device != torch.device(device)
        or not torch.equal(state[k].cpu(), v.cpu())
    ]
    if bad:
        raise RuntimeError(f"{what} did not reload equal: {bad[:8]}")
    logger.info("validated %s", checkpoint_path)
