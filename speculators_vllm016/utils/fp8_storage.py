"""Hidden states stored as fp8 (e4m3) with one scale per token and layer: half of bf16's bytes.

A captured layer `[T, H]` becomes an fp8 payload `[T, H]` (`torch.float8_e4m3fn`) and an fp32
scale `[T, 1]`: each token's largest magnitude is mapped onto e4m3's largest finite value (448),
so no value saturates and the relative rounding error of every value in the normal range is at
most 2**-4 (3 mantissa bits); values below 2**-6 of the scale lose relative precision (e4m3's
subnormals) and the absolute error there is at most `scale * 2**-10`. `error_bound` states it.

The payload travels as it is (files, loader rows, the copy to the device) and is turned back into
the working dtype only on the training device (`dequantize_fused`), where a packed row's fused
input of k layers `[.., k*H]` meets its scales `[.., k]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where states are converted: `--help` needs none
    import torch

__all__ = [
    "FP8_MAX",
    "STORAGE_DTYPES",
    "dequantize",
    "dequantize_fused",
    "error_bound",
    "fp8_dtype",
    "quantize",
]

STORAGE_DTYPES = ("bf16", "fp8")
"""`--storage-dtype` choices: "bf16" keeps the engine's states as they are (bf16 on a GPU; the
CPU engine's float32 stays float32), "fp8" stores e4m3 with a scale per token and layer."""

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_MIN_SCALE = 1e-30  # an all-zero token keeps a positive scale: 0 / scale stays 0, never NaN


def fp8_dtype() -> torch.dtype:
    import torch

    return torch.float8_e4m3fn


def quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, H]` states -> (fp8 payload `[T, H]`, fp32 scale `[T, 1]`), one scale per token.

    Computed in fp32 whatever the input dtype; a non-finite token gets a non-finite scale, which
    the trainer refuses like a non-finite bf16 state.
    """
    import torch

    wide = states.to(torch.float32)
    amax = wide.abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(amax / FP8_MAX, min=_MIN_SCALE)
    payload = (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(fp8_dtype())
    return payload.contiguous(), scale.contiguous()


def dequantize(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(fp8 `[.., H]`, scale `[.., 1]`) -> states of `dtype` (multiplied in fp32, then cast)."""
    import torch

    return (payload.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def dequantize_fused(
    payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A packed row's fused states: fp8 `[.., k*H]` with scales `[.., k]` (one per layer) ->
    `[.., k*H]` of `dtype`. With k = 1 it is the teacher's layer."""
    import torch

    layers = int(scales.shape[-1])
    width = int(payload.shape[-1]) // layers
    split = payload.to(torch.float32).unflatten(-1, (layers, width))
    return (split * scales.to(torch.float32).unsqueeze(-1)).flatten(-2).to(dtype)


def error_bound(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |states - dequantize(quantize(states))| per value, in fp32: half an e4m3 step
    (2**-4 relative) in the normal range, `scale * 2**-10` among the subnormals."""
    import torch

    wide = states.to(torch.float32).abs()
    return torch.maximum(wide * 2.0**-4, scale.to(torch.float32) * 2.0**-10)
