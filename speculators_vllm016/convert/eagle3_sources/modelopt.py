"""NVIDIA Model Optimizer's EAGLE-3 export (`export/plugins/hf_spec_export.py`).

Config: `LlamaForCausalLMEagle3` (older exports `LlamaForCausalLM`), the Llama fields,
`draft_vocab_size`, and an `eagle_config` with `eagle_aux_hidden_state_layer_ids`,
`use_aux_hidden_state`, `use_input_layernorm_in_first_layer`, `use_last_layernorm`,
`use_mtp_layernorm`. Weights: `midlayer.*` (with `midlayer.hidden_norm` and
`midlayer.input_layernorm`, the embeddings' norm), `norm`, `fc`, `lm_head`, `d2t`; no `t2d`
(rebuilt here from `d2t`: draft token d is target token d + d2t[d]) and no embeddings (the
converter takes the verifier's).

Fused layers, one rule by the length of the recorded list:
- three ids: its HF plugin hooks the *output* of base layer i and calls it i, default
  [1, N//2 - 1, N - 4]; ours is i + 1.
- four ids whose last is N or N - 1 (N target layers): the list of its vLLM-collected recipes
  (Kimi-K2.5's: [2, 30, 58, 61] on 61 layers). These are vLLM's capture ids (input of layer i,
  so 2, 30, 58 are the outputs of layers 1, 29, 57: the layers TorchSpec's Kimi-K2.5 MLA draft
  records as [1, 29, 57]); the fourth is the final layer the draft is trained against, not a
  fused one: N is the last layer's output before the final norm (in vLLM's numbering "the input
  of layer N", which vLLM only captures with a fix, as the recipe notes; the plugin captures it),
  N - 1 the stand-in the recipe names without the fix. The draft fuses the first three, as they
  are. A fourth id that is neither, or first three out of order or range, is refused.
Residual: the first layer's residual is the fused state before `hidden_norm`
(`norm_before_residual` false).
"""

from __future__ import annotations

from typing import Any

import torch

from speculators_vllm016.convert.eagle3_sources import (
    SourceDraft,
    post_layer_ids_to_ours,
    target_layer_count,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["adapt", "modelopt_layer_ids"]


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
    ids = modelopt_layer_ids(recorded, verifier_config) if map_ids else None
    weights = dict(weights)
    if "d2t" in weights and "t2d" not in weights:
        weights["t2d"] = _t2d_from_d2t(weights["d2t"], _target_vocab(verifier_config))
    return SourceDraft("modelopt", config, weights, ids, False)


def modelopt_layer_ids(recorded: Any, verifier_config: dict[str, Any]) -> list[int]:
    """The fused layers of a ModelOpt draft in our (vLLM's) numbering (see the module docstring)."""
    if not (isinstance(recorded, list) and len(recorded) == 4):
        return post_layer_ids_to_ours(recorded, verifier_config, "modelopt")
    layers = target_layer_count(verifier_config)
    *fused, final = recorded
    if not all(isinstance(i, int) for i in recorded):
        raise InvalidInputError(
            f"modelopt: eagle_aux_hidden_state_layer_ids must be ints: {recorded}"
        )
    if final not in (layers, layers - 1):
        raise InvalidInputError(
            f"modelopt: a four-id list {recorded} must end in the final layer of the {layers}-layer "
            f"target ({layers}, or {layers - 1} without vLLM's capture fix); give the fused "
            "layers explicitly (eagle_aux_hidden_state_layer_ids, vLLM's numbering)"
        )
    if not 0 <= fused[0] < fused[1] < fused[2] <= layers:
        raise InvalidInputError(
            f"modelopt: fused layers {fused} of {recorded} are not increasing ids in 0..{layers}"
        )
    return list(fused)


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
