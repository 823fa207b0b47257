"""Whether a checkpoint stores a module quantized, from the tensors it holds and its config.

A draft copies some verifier tensors as they are (embeddings, final norm, LM head); a quantized
one (compressed-tensors' `weight_packed` + `weight_scale`, FP8 blocks with `weight_scale_inv`,
integer or FP8 `weight`) would be copied as garbage or not found at all. The INT4 Kimi-K2.5
release quantizes only the routed experts, which a draft never reads; this module says when a
checkpoint quantizes more than that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "FULL_PRECISION_DTYPES",
    "QUANTIZATION_TENSOR_SUFFIXES",
    "config_quantizes",
    "quantization_config_of",
    "quantized_storage",
]

# What quantizers store beside (or instead of) a module's `weight`.
QUANTIZATION_TENSOR_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_global_scale",
    "weight_scale_inv",
    "weight_g_idx",
    "qweight",
    "qzeros",
    "scales",
)
FULL_PRECISION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def quantization_config_of(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The `quantization_config` of a config.json dict, at the top or in its text config
    (Kimi-K2.5 may keep it in `text_config`)."""
    for candidate in (config, config.get("text_config")):
        if isinstance(candidate, Mapping) and isinstance(
            candidate.get("quantization_config"), Mapping
        ):
            return candidate["quantization_config"]
    return None


def quantized_storage(module: str, names: Iterable[str]) -> list[str]:
    """The quantization tensors of `module` (e.g. `lm_head`) among the checkpoint's `names`."""
    present = set(names)
    return [suffix for suffix in QUANTIZATION_TENSOR_SUFFIXES if f"{module}.{suffix}" in present]


def _matches(entry: str, module: str, module_class: str | None) -> bool:
    """compressed-tensors' target rule: `re:` regexes, exact module names, or a class name. A
    plain name also matches a module that ends with it (ignore lists often use the text model's
    names, e.g. `lm_head` for a wrapper's `language_model.lm_head`)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry in (module, module_class) or module.endswith("." + entry)


def config_quantizes(
    quantization_config: Mapping[str, Any] | None, module: str, module_class: str | None
) -> bool:
    """A compressed-tensors config that quantizes `module` (a `config_groups` target matches and
    the `ignore` list does not). Other methods are judged by the tensors alone."""
    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return False
    ignore = quantization_config.get("ignore") or []
    if any(_matches(entry, module, module_class) for entry in ignore):
        return False
    for group in (quantization_config.get("config_groups") or {}).values():
        if not isinstance(group, Mapping) or group.get("weights") is None:
            continue
        if any(_matches(target, module, module_class) for target in group.get("targets") or []):
            return True
    return False
