"""The TTT steps' key/value cache (`packed_row.StepKeyValues`): the keys each step attends over,
padded to the compiled flex kernel's one key length when it has one."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.models.eagle3.packed_row import StepKeyValues
from speculators_vllm016.utils.errors import InvalidInputError


def _blocks(steps: int, dim: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # [B, H, L, D] views of [B, L, H, D] memory, as the layers hand them over
    return [
        torch.randn(1, 2, 3, dim, generator=generator).transpose(1, 2).requires_grad_()
        for _ in range(steps)
    ]


def test_without_a_capacity_each_step_sees_the_steps_so_far() -> None:
    cache = StepKeyValues()
    keys, values = _blocks(3), _blocks(3, dim=5)
    for step in range(3):
        key, value = cache.update(keys[step], values[step], layer_idx=0)
        assert torch.equal(key, torch.cat(keys[: step + 1], dim=-2))
        assert torch.equal(value, torch.cat(values[: step + 1], dim=-2))


def test_with_a_capacity_every_step_is_padded_to_it_and_the_gradients_reach_each_block() -> None:
    """Each step's keys: the steps so far, its block, zeros to the capacity; the padding takes
    no gradient, each block exactly what its positions got at every step; the cache keeps the
    tensors it handed out (flex saves those: nothing held twice)."""
    steps, capacity = 3, 6
    keys, values = _blocks(steps), _blocks(steps, dim=5)
    cache = StepKeyValues(capacity)
    handed = []
    for step in range(steps):
        key, value = cache.update(keys[step], values[step], layer_idx=1)
        real = 2 * (step + 1)
        assert key.shape[-2] == value.shape[-2] == capacity
        assert torch.equal(key[..., :real, :], torch.cat(keys[: step + 1], dim=-2))
        assert torch.equal(value[..., :real, :], torch.cat(values[: step + 1], dim=-2))
        assert not key[..., real:, :].any() and not value[..., real:, :].any()
        assert cache.layers[1][0] is key and cache.layers[1][1] is value
        assert cache.lengths[1] == real
        handed.append((key, value))
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(k.shape, generator=generator) for k, _ in handed]
    sum((k * w).sum() + v.sum() for (k, v), w in zip(handed, weights, strict=True)).backward()
    for index, block in enumerate(keys):
        positions = slice(2 * index, 2 * index + 2)
        expected = sum(w[..., positions, :] for w in weights[index:])
        torch.testing.assert_close(block.grad, expected, rtol=0, atol=1e-6)
        assert torch.equal(values[index].grad, torch.full_like(values[index], steps - index))


def test_layers_are_kept_apart_and_a_step_past_the_capacity_is_refused() -> None:
    cache = StepKeyValues(4)
    first, second, third = _blocks(3)
    cache.update(first, first, layer_idx=0)
    key, _ = cache.update(second, second, layer_idx=1)  # another layer's first step
    assert torch.equal(key[..., :2, :], second) and cache.lengths == {0: 2, 1: 2}
    cache.update(third, third, layer_idx=0)
    with pytest.raises(InvalidInputError, match="exceed the capacity 4"):
        cache.update(first, first, layer_idx=0)
