"""Noise added to the draft's input hidden states during training (0.3.0's transforms).

A transform is called on one standardized sample (a dict of tensors) and perturbs the tensors it
names. By default only the fused input states (`hidden_states`) are perturbed: the teacher's states
(`verifier_last_hidden_states`) define the targets and stay clean (0.3.0's D3).

Offline training draws the noise where the packed row already is, on the training device
(`RowNoise.apply`): per sample, a generator seeded by `(seed, epoch, sample index)` noises the span
that sample occupies in the row. The loader's workers then only read and pack bf16 rows, and the
noise never depends on which worker read a sample, on resume or on the rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AddGaussianNoise", "AddUniformNoise", "RowNoise", "TransformTensors", "noise_seed"]


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

    def noised(self, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """`tensor` plus noise drawn from `generator` on its device, computed in fp32 and rounded
        once to `tensor`'s dtype. Subclasses that only define `transform` get it through the
        global generator of the tensor's device, seeded from `generator` for the call."""
        devices = [tensor.device] if tensor.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=tensor.device.type):
            if tensor.device.type == "cuda":
                torch.cuda.manual_seed(generator.initial_seed())
            else:
                torch.manual_seed(generator.initial_seed())
            return self.transform(tensor.float()).to(tensor.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(std={self.std}, tensors={self.tensors})"


class AddGaussianNoise(TransformTensors):
    """Adds N(0, std^2) noise."""

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.std * torch.randn_like(tensor)

    def noised(self, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(tensor.shape, generator=generator, device=tensor.device)
        return noise.mul_(self.std).add_(tensor).to(tensor.dtype)


class AddUniformNoise(TransformTensors):
    """Adds noise drawn uniformly from [-std, std] (0.3.0 calls the half-width `std`)."""

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.std * (2.0 * torch.rand_like(tensor) - 1.0)

    def noised(self, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.rand(tensor.shape, generator=generator, device=tensor.device)
        return noise.mul_(2.0 * self.std).sub_(self.std).add_(tensor).to(tensor.dtype)


def noise_seed(seed: int, epoch: int, index: int) -> int:
    """A distinct, stable seed per (run seed, epoch, sample) so noise never depends on workers."""
    mixed = (seed * 1_000_003 + epoch) * 1_000_033 + index
    return mixed % (2**63 - 1)


@dataclass(frozen=True)
class RowNoise:
    """The noise of one packed row's samples, drawn on the row's device (see the module doc).

    The loader attaches it in the main process, where the epoch is known (persistent workers
    never see `set_epoch`); `apply` runs once the row is on the training device.
    """

    transform: TransformTensors
    seed: int
    epoch: int

    def apply(
        self, inputs: Mapping[str, torch.Tensor], lengths: Sequence[int], indices: Sequence[int]
    ) -> None:
        """Noise, in place, sample `indices[k]`'s span (`lengths[k]` tokens, laid end to end
        from the row's start) of each tensor the transform names, in `inputs` ([1, T, W])."""
        names = [name for name in self.transform.tensors if name in inputs]
        if not names:
            return
        device = inputs[names[0]].device
        start = 0
        for length, index in zip(lengths, indices, strict=True):
            generator = torch.Generator(device=device)
            generator.manual_seed(noise_seed(self.seed, self.epoch, int(index)))
            for name in names:
                span = inputs[name][0, start : start + int(length)]
                span.copy_(self.transform.noised(span, generator))
            start += int(length)
