"""EAGLE-3 Llama-layer drafts trained by other tools, read into the research layout that
`Eagle3Converter` converts: one module per source, each the one documented mapping of its
tool's config keys, tensor names and auxiliary layer ids into ours.

Our numbering of a fused layer (the draft config's `eagle_aux_hidden_state_layer_ids`) is vLLM's:
id i is the input of target decoder layer i, i.e. the output of layer i - 1
(`utils/layer_ids.py`). The sources:

| source | how it is recognized | its ids | into ours |
| --- | --- | --- | --- |
| `research` (SafeAILab EAGLE-3, SpecForge) | anything else | SGLang's / vLLM's capture ids, when recorded | as they are |
| `torchspec` (TorchSpec's `LlamaForCausalLMEagle3`) | `_torchspec_version` in config.json | the output of layer i (forward hooks on the layers) | i + 1; none recorded: TorchSpec's default [1, N//2 - 1, N - 4] + 1 |
| `modelopt` (NVIDIA Model Optimizer's export) | an `eagle_config` with `use_mtp_layernorm` | three ids: the output of layer i (its HF plugin's hooks); four ids ending in N or N - 1: its vLLM-collected recipe (vLLM's ids, the fourth the final layer it trains against) | three: i + 1; four: the first three as they are; none recorded: ModelOpt's default [1, N//2 - 1, N - 4] + 1 |

Upstream speculators 0.7 drafts are in the speculators format already (`speculators_model_type`),
read as they are (`norm_before_fc`, `fc_norm`, `norm_output` included); their ids are vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "SOURCES",
    "SourceDraft",
    "adapt_checkpoint",
    "detect_source",
    "post_layer_ids_to_ours",
    "target_layer_count",
]

SOURCES = ("research", "torchspec", "modelopt")


@dataclass
class SourceDraft:
    """A source's checkpoint in the research layout, with what its source says about it."""

    source: str
    config: dict[str, Any]
    """The config.json the converter reads (Llama fields, `draft_vocab_size`, ...)."""
    weights: dict[str, torch.Tensor]
    """Research names: `midlayer.*` or `layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, ..."""
    aux_layer_ids: list[int] | None
    """The fused layers in our (vLLM's) numbering; None: not known from the checkpoint."""
    norm_before_residual: bool | None
    """The residual placement its tool trains with; None: the tool leaves it to the user."""


def detect_source(config: dict[str, Any]) -> str:
    """Which tool wrote a research-layout checkpoint, from its config.json."""
    if "_torchspec_version" in config:
        return "torchspec"
    eagle = config.get("eagle_config")
    if isinstance(eagle, dict) and "use_mtp_layernorm" in eagle:
        return "modelopt"
    return "research"


def adapt_checkpoint(
    source: str | None,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    aux_layer_ids: list[int] | None = None,
) -> SourceDraft:
    """The checkpoint as `source` (None: detected) wrote it, mapped into the research layout.
    `aux_layer_ids` (ours) given: they are the draft's, and the source's ids are not read."""
    from speculators_vllm016.convert.eagle3_sources import modelopt, research, torchspec

    name = source or detect_source(config)
    readers = {"research": research.adapt, "torchspec": torchspec.adapt, "modelopt": modelopt.adapt}
    if name not in readers:
        raise InvalidInputError(f"unknown draft source {name!r}; choose one of {SOURCES}")
    adapted = readers[name](config, weights, verifier_config, map_ids=aux_layer_ids is None)
    if aux_layer_ids is not None:
        adapted.aux_layer_ids = list(aux_layer_ids)
    return adapted


def target_layer_count(verifier_config: dict[str, Any]) -> int:
    """The target's number of decoder layers (of its text model inside a wrapper)."""
    from speculators_vllm016.utils.text_config import text_config_of

    layers = text_config_of(verifier_config).get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise InvalidInputError("the verifier's config.json has no usable num_hidden_layers")
    return layers


def post_layer_ids_to_ours(
    ids: list[int] | None, verifier_config: dict[str, Any], source: str
) -> list[int]:
    """Ids that number the output of layer i as i (TorchSpec, ModelOpt), in our numbering (+1);
    None: the tool's default [1, N//2 - 1, N - 4]. An id past the target's last layer is refused
    (the checkpoint was made with another numbering: give the ids explicitly)."""
    layers = target_layer_count(verifier_config)
    if ids is None:
        if layers < 4:
            raise InvalidInputError(
                f"{source}: the draft records no fused layers and a {layers}-layer target has "
                "no default; give eagle_aux_hidden_state_layer_ids (vLLM's numbering)"
            )
        ids = [1, layers // 2 - 1, layers - 4]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise InvalidInputError(f"{source}: eagle_aux_hidden_state_layer_ids must be ints: {ids}")
    ours = [i + 1 for i in ids]
    if any(not 0 < i <= layers for i in ours):
        raise InvalidInputError(
            f"{source}: aux layer ids {ids} (output of layer i) do not fit a {layers}-layer "
            "target; give the fused layers explicitly (eagle_aux_hidden_state_layer_ids, in "
            "vLLM's numbering: input of layer i)"
        )
    return ours
