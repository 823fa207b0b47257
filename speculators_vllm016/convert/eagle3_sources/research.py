"""SafeAILab's EAGLE-3 releases and SpecForge's exports: the layout `Eagle3Converter` reads.

Their fused layers, when the config records them (top level or `eagle_config`), are SGLang's
or vLLM's capture ids (the input of layer i): ours, taken as they are. The residual placement is
not recorded: the caller's choice stands.
"""

from __future__ import annotations

from typing import Any

import torch

from speculators_vllm016.convert.eagle3_sources import SourceDraft

__all__ = ["adapt"]


def adapt(
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    map_ids: bool = True,
) -> SourceDraft:
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return SourceDraft("research", config, weights, list(ids) if ids else None, None)
