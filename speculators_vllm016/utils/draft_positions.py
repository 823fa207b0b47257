"""The rotary settings of an EAGLE-3 draft's Llama layer, from its target's text config.

A draft is trained by this package (transformers' Llama rotary embedding) and served by vLLM 0.16
(`Eagle3LlamaForCausalLM`, whose layer builds its rotary module with `get_rope` from the same
config). Its acceptance at a position holds only if both compute the same cos/sin there, and at
long contexts only if the draft's positions stretch the way the target's do. So the draft takes
the target's theta, its scaling and its maximum positions, written in the one form both libraries
read alike:

* plain, `linear` and `llama3` scaling: as the target writes them (both libraries agree);
* `yarn`, also DeepSeek-V3 / Kimi-K2's (`mscale`, `mscale_all_dim`) and `deepseek_yarn`: the
  target's factor, original window and betas, without the magnitude fields. transformers divides
  `mscale` by `mscale_all_dim` (1.0 for DeepSeek-V3) where vLLM's Llama-layer YaRN ignores both
  and scales cos/sin by `0.1 ln(factor) + 1`; without them both use `0.1 ln(factor) + 1`, which
  squared is the factor DeepSeek's attention puts on its own logits. It is what the published
  Kimi-K2.5 drafts write (factor 64 from 4096, beta_fast 32, beta_slow 1, theta 50000).
* `dynamic`: vLLM fixes the stretched base once for all positions where transformers changes it
  with the sequence length; the draft gets vLLM's base as a plain theta and vLLM's stretched
  maximum (`factor` times the target's), which is what vLLM serves.
* M-RoPE (`mrope`, or an `mrope_section`): text positions are the same on every axis, which is
  plain RoPE.
* anything else (`longrope`, ...): plain RoPE with the target's theta, and a warning: both
  libraries then agree, though the draft's positions do not stretch as the target's do.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DraftPositions", "draft_positions"]

logger = logging.getLogger(__name__)

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
_AS_WRITTEN = ("linear", "llama3")  # both libraries read these alike


@dataclass(frozen=True)
class DraftPositions:
    """What the draft's `transformer_layer_config` says about positions."""

    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


def draft_positions(text_config: Any, head_dim: int) -> DraftPositions:
    """The draft's rotary settings for a target whose text model's config is `text_config`
    (an object with the config's fields as attributes); `head_dim` is the draft's head size."""
    scaling = getattr(text_config, "rope_scaling", None) or getattr(
        text_config, "rope_parameters", None
    )
    scaling = dict(scaling) if scaling else None
    theta = getattr(text_config, "rope_theta", None) or (scaling or {}).get("rope_theta") or 10000.0
    max_positions = int(getattr(text_config, "max_position_embeddings", None) or 4096)
    kind = _rope_type(scaling)
    if kind is None:
        return DraftPositions(float(theta), None, max_positions)
    if kind in ("yarn", "deepseek_yarn"):
        kept = {key: scaling[key] for key in _YARN_KEYS if scaling.get(key) is not None}
        kept.setdefault("original_max_position_embeddings", max_positions)
        return DraftPositions(float(theta), {"rope_type": "yarn", **kept}, max_positions)
    if kind in _AS_WRITTEN:
        kept = {
            key: value
            for key, value in scaling.items()
            if key not in ("rope_theta", "type") and not key.startswith("mrope")
        }
        return DraftPositions(float(theta), {**kept, "rope_type": kind}, max_positions)
    if kind == "dynamic":
        factor = float(scaling["factor"])
        base = theta * (factor * factor - factor + 1) ** (head_dim / (head_dim - 2))
        return DraftPositions(float(base), None, int(max_positions * factor))
    logger.warning(
        "the target's rope type %r has no form that transformers and vLLM compute alike for the "
        "draft's Llama layer; the draft uses plain RoPE (theta %s), whose positions do not "
        "stretch as the target's do",
        kind,
        theta,
    )
    return DraftPositions(float(theta), None, max_positions)


def _rope_type(scaling: dict[str, Any] | None) -> str | None:
    """The scaling's type, None for plain RoPE (also M-RoPE, plain on text positions)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind in ("default", "mrope") or "mrope_section" in scaling:
        return None
    if kind in ("linear", "dynamic", "yarn") and not _stretches(scaling):
        return None
    return kind


def _stretches(scaling: dict[str, Any]) -> bool:
    """False for a factor of 1 or less (plain RoPE in both libraries)."""
    factor = scaling.get("factor")
    return factor is None or (float(factor) > 1.0 and not math.isclose(float(factor), 1.0))
