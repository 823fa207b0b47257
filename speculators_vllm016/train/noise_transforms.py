"""Noise added to the draft's input hidden states during training (0.3.0's transforms).

A transform is called on one standardized sample (a dict of tensors) and perturbs the tensors it
names. By default only the fused input states (`hidden_states`) are perturbed: the teacher's states
(`verifier_last_hidden_states`) define the targets and stay clean (0.3.0's D3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["AddGaussianNoise", "AddUniformNoise", "TransformTensors"]


class TransformTensors:
    """Applies `transform` to each tensor named in `tensors`; subclasses define `transform`."""

    def __init__(self, std: float = 0.05, tensors: Sequence[str] = ("hidden_states",)) -> None:
        self.std = std
        self.tensors = tuple(tensors)

    def __call__(self, data: dict[str, Any]) -> dict[str, Any]:
        for name in self.tensors:
            data[name] = self.transform(data[name])
        return data

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define transform()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(std={self.std}, tensors={self.tensors})"


class AddGaussianNoise(TransformTensors):
    """Adds N(0, std^2) noise."""

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.std * torch.randn_like(tensor)


class AddUniformNoise(TransformTensors):
    """Adds noise drawn uniformly from [-std, std] (0.3.0 calls the half-width `std`)."""

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.std * (2.0 * torch.rand_like(tensor) - 1.0)
