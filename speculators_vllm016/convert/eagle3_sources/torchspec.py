"""TorchSpec's Llama-layer EAGLE-3 draft (`LlamaForCausalLMEagle3`, `tools/convert_to_hf.py`).

Config: a Llama config (its Kimi-K2.5 draft: hidden 7168, 64 heads of 128, yarn RoPE, full
163,840 vocabulary) plus `draft_vocab_size` and `_torchspec_version`. Weights: `embed_tokens`,
`midlayer.*` (`layers.0.*` when exported for vLLM), `fc`, `norm`, `lm_head`, and `d2t`/`t2d` only
when the vocabulary was pruned (identity maps otherwise).

Fused layers: TorchSpec hooks the *output* of target layer i and calls it i (its own tests say
so: "post-layer semantics"), default [1, N//2 - 1, N - 4]; ours is i + 1. Its Llama-layer config
records none, so the default applies: for Kimi-K2.5 (61 layers) [1, 29, 57] -> ours [2, 30, 58].
Residual: its first layer keeps the fused state before `hidden_norm` as the residual
(`norm_before_residual` false).
"""

from __future__ import annotations

from typing import Any

import torch

from speculators_vllm016.convert.eagle3_sources import SourceDraft, post_layer_ids_to_ours

__all__ = ["adapt"]


def adapt(
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    map_ids: bool = True,
) -> SourceDraft:
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    recorded = eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = post_layer_ids_to_ours(recorded, verifier_config, "torchspec") if map_ids else None
    return SourceDraft("torchspec", config, weights, ids, False)
