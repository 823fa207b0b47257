"""NVIDIA Model Optimizer's EAGLE-3 export (`export/plugins/hf_spec_export.py`).

Config: `LlamaForCausalLMEagle3` (older exports `LlamaForCausalLM`), the Llama fields,
`draft_vocab_size`, and an `eagle_config` with `eagle_aux_hidden_state_layer_ids`,
`use_aux_hidden_state`, `use_input_layernorm_in_first_layer`, `use_last_layernorm`,
`use_mtp_layernorm`. Weights: `midlayer.*` (with `midlayer.hidden_norm` and
`midlayer.input_layernorm`, the embeddings' norm), `norm`, `fc`, `lm_head`, `d2t`; no `t2d`
(rebuilt here from `d2t`: draft token d is target token d + d2t[d]) and no embeddings (the
converter takes the verifier's).

Fused layers: its HF plugin hooks the *output* of base layer i and calls it i, default
[1, N//2 - 1, N - 4]; ours is i + 1. (Its Kimi-K2.5 recipe, which collects states with vLLM,
names vLLM's ids [2, 30, 58, 61]: four fused layers, which this draft does not take, and a 61
that no 61-layer target has under this mapping, so it is refused; give those ids explicitly.)
Residual: the first layer's residual is the fused state before `hidden_norm`
(`norm_before_residual` false).
"""

from __future__ import annotations

from typing import Any

import torch

from speculators_vllm016.convert.eagle3_sources import SourceDraft, post_layer_ids_to_ours
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["adapt"]


def adapt(
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    map_ids: bool = True,
) -> SourceDraft:
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise InvalidInputError(
            "modelopt: use_aux_hidden_state is false (an EAGLE-1-style draft), not EAGLE-3"
        )
    recorded = eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = post_layer_ids_to_ours(recorded, verifier_config, "modelopt") if map_ids else None
    weights = dict(weights)
    if "d2t" in weights and "t2d" not in weights:
        weights["t2d"] = _t2d_from_d2t(weights["d2t"], _target_vocab(verifier_config))
    return SourceDraft("modelopt", config, weights, ids, False)


def _target_vocab(verifier_config: dict[str, Any]) -> int:
    from speculators_vllm016.utils.verifier_config import find_vocab_size

    vocab = find_vocab_size(verifier_config)
    if vocab is None:
        raise InvalidInputError("modelopt: the verifier's config.json has no vocab_size")
    return int(vocab)


def _t2d_from_d2t(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """The target tokens the draft vocabulary covers (d2t holds offsets: target = d + d2t[d])."""
    targets = torch.arange(d2t.shape[0]) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= target_vocab:
        raise InvalidInputError(f"modelopt: d2t points outside the {target_vocab}-token vocabulary")
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[targets] = True
    return t2d
