"""Hidden states as the sample files store them, on their way into training rows: finiteness
checks in the file's own dtype, and fp8 states (`--storage-dtype fp8`) kept as fp8 with their
scales so that the trainer dequantizes them on its device (`loading.device_rows`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "STATE_SCALES",
    "all_finite",
    "fp8_row_layers",
    "is_fp8",
    "payload_as_states",
    "shift_scales",
    "standardize_fp8",
    "states_finite",
]

STATE_SCALES = {
    "hidden_states": "hidden_states_scale",
    "verifier_last_hidden_states": "verifier_last_hidden_states_scale",
}
"""The scale key of each state of a row read from fp8 files by a dataset with
`device_dequantize=True`: the state is then fp8 (`[1, T, k*H]`) and its scale `[1, T, k]` (one
per layer, of the dtype the states return to); `device_rows` dequantizes them on the device."""


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, in the tensor's own dtype (no fp32 copy).

    The sum is one fast pass and is finite when every value is; only a non-finite sum (a NaN or
    inf, or an overflow of large finite values) pays for the exact check.
    """
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float8_e4m3fn


def standardize_fp8(
    raw: dict[str, Any], standardize_fn: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """A stored fp8 sample standardized as its bf16 form would be: the payloads and the scales
    each through `standardize_fn`, so a scale sits where its layer does (`STATE_SCALES`)."""
    base = {"input_ids": raw["input_ids"], "loss_mask": raw["loss_mask"]}
    data = standardize_fn({**base, "hidden_states": raw["hidden_states_fp8"]})
    scales = standardize_fn({**base, "hidden_states": raw["hidden_states_scale"]})
    for key, scale_key in STATE_SCALES.items():
        data[scale_key] = scales[key]
    return data


def states_finite(data: dict[str, Any], key: str) -> bool:
    """Whether a standardized state is finite; an fp8 state through its scale (fp8 e4m3 has NaN
    but no inf, and a non-finite token's scale is non-finite)."""
    if not is_fp8(data[key]):
        return all_finite(data[key])
    return all_finite(data[STATE_SCALES[key]]) and not bool(torch.isnan(data[key]).any())


def payload_as_states(raw: dict[str, Any]) -> dict[str, Any]:
    """A stored sample whose fp8 payloads (if any) stand under `hidden_states`: their shapes are
    the states' shapes (for shape checks, never for values)."""
    if "hidden_states_fp8" not in raw:
        return raw
    return {**raw, "hidden_states": raw["hidden_states_fp8"]}


def shift_scales(batch: dict[str, Any], shifted: dict[str, Any]) -> dict[str, Any]:
    """`shifted` (`train.data.shift_batch`'s) with the fp8 scales of `batch` shifted as their
    states are: the fused input's token t, the teacher's token t + 1."""
    fused, last = STATE_SCALES.values()
    if fused in batch:
        shifted[fused] = batch[fused][:-1]
        shifted[last] = batch[last][1:]
    return shifted


def fp8_row_layers(dataset: Any) -> tuple[int, int] | None:
    """(fused layers, teacher layers) of an `Eagle3SampleFileDataset`'s rows when they carry fp8
    states to the device (`device_dequantize` and its first file stored as fp8); else None."""
    from speculators_vllm016.data_generation.sample_io import is_fp8_sample, load_sample

    if not getattr(dataset, "device_dequantize", False) or not dataset.data:
        return None
    try:
        raw = load_sample(dataset.data[0], mmap=True, dequantize=False)
    except Exception:  # noqa: BLE001 - an unusable file is refused when it is read
        return None
    if not is_fp8_sample(raw):
        return None
    data = standardize_fp8(raw, dataset.standardize_fn)
    fused, last = (int(data[STATE_SCALES[key]].shape[-1]) for key in STATE_SCALES)
    return fused, last
