"""fp8 storage of hidden states: the round trip stays within the stated bound, per token."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.utils.fp8_storage import (
    FP8_MAX,
    dequantize,
    dequantize_fused,
    error_bound,
    quantize,
)


def residual_like(tokens: int = 64, width: int = 256, seed: int = 0) -> torch.Tensor:
    """States with per-token magnitudes over 6 decades and a few outlier channels, as residual
    streams have."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(tokens, width, generator=generator)
    states *= torch.logspace(-3, 3, tokens)[:, None]
    states[:, :3] *= 60.0  # outlier channels
    states[5] = 0.0  # a token of zeros
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_the_bound_for_every_value(dtype):
    states = residual_like().to(dtype)
    payload, scale = quantize(states)
    assert payload.dtype == torch.float8_e4m3fn and payload.shape == states.shape
    assert scale.dtype == torch.float32 and scale.shape == (states.shape[0], 1)
    back = dequantize(payload, scale, torch.float32)
    error = (back - states.float()).abs()
    assert (error <= error_bound(states, scale)).all()
    # Each token's largest value is stored exactly (it maps onto 448): nothing saturates.
    assert torch.equal(
        payload.float().abs().amax(dim=-1)[states.float().abs().amax(-1) > 0],
        torch.full((states.shape[0] - 1,), FP8_MAX),
    )
    assert not back[5].any()  # zeros stay zeros, no NaN from a zero scale


def test_one_scale_per_token_keeps_small_tokens_precise():
    """A token 10^6 times smaller than another keeps its own relative precision."""
    states = residual_like()
    payload, scale = quantize(states)
    back = dequantize(payload, scale, torch.float32)
    relative = (back - states).norm(dim=-1) / states.norm(dim=-1).clamp_min(1e-30)
    assert relative[states.norm(dim=-1) > 0].max() < 2.0**-4


def test_non_finite_token_gets_a_non_finite_scale():
    states = residual_like(tokens=8)
    states[2, 7] = float("inf")
    _, scale = quantize(states)
    assert not torch.isfinite(scale[2]).all() and torch.isfinite(scale[[0, 1, 3, 4]]).all()


def test_fused_dequantization_uses_each_layers_own_scale():
    layers = [residual_like(seed=seed) * (10.0**seed) for seed in range(3)]
    quantized = [quantize(layer) for layer in layers]
    fused = torch.cat([payload for payload, _ in quantized], dim=-1)
    scales = torch.cat([scale for _, scale in quantized], dim=-1)
    expected = torch.cat([dequantize(p, s, torch.float32) for p, s in quantized], dim=-1)
    assert torch.equal(dequantize_fused(fused, scales, torch.float32), expected)
    batched = dequantize_fused(fused[None], scales[None], torch.bfloat16)
    assert batched.dtype == torch.bfloat16 and torch.equal(batched[0], expected.bfloat16())
