"""Decoder-layer building blocks of the EAGLE-3 draft, per transformer family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import Cache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

__all__ = ["LlamaDecoderEagle3FirstLayer", "ModelComponents", "model_classes", "maybe_compiled"]

_COMPILED: dict[Callable, Callable] = {}


def maybe_compiled(function: Callable, enabled: bool) -> Callable:
    """`function` compiled once per process (shared by all callers), or itself.

    Compiled with automatic dynamic shapes: a second row length recompiles once with a symbolic
    length, never once per batch shape.
    """
    if not enabled:
        return function
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function)
    return _COMPILED[function]


def _attention_inputs(layer: LlamaDecoderEagle3FirstLayer, hidden_states: torch.Tensor):
    embeds, hidden = hidden_states.chunk(2, dim=-1)
    normed_hidden = layer.hidden_norm(hidden)
    residual = normed_hidden if layer.norm_before_residual else hidden
    attention_input = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)
    # fp32 norm weights promote their outputs to fp32 under autocast; hand the projections
    # (which autocast would cast anyway) the step's own dtype and keep no fp32 copies.
    dtype = hidden_states.dtype
    return attention_input.to(dtype), residual.to(dtype)


def _residual_mlp(
    layer: LlamaDecoderEagle3FirstLayer, residual: torch.Tensor, attended: torch.Tensor,
    dtype: torch.dtype,
):
    hidden = residual + attended
    # Under autocast with fp32 norm weights the sum is promoted to fp32; the step's output
    # keeps the dtype the step was fed, so every TTT step (and its saved state) is alike.
    return (hidden + layer.mlp(layer.post_attention_layernorm(hidden))).to(dtype)


class LlamaDecoderEagle3FirstLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention reads `[token embedding ; fused hidden state]`.

    The two halves are normalized separately (`input_layernorm` for the embedding, `hidden_norm`
    for the hidden state); q/k/v project from twice the hidden size. The residual is the hidden
    half, normalized first when `norm_before_residual`.

    `compile_blocks` (set by the draft model on accelerators) compiles the element-wise work
    around attention (norms, residuals, MLP) so that fewer and smaller activations are kept;
    `recompute_mlp` keeps only the MLP's input and recomputes the rest in the backward pass.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int, norm_before_residual: bool = False):
        super().__init__(config, layer_idx)
        self.norm_before_residual = norm_before_residual
        self.compile_blocks = False
        self.recompute_mlp = False
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        wide = 2 * config.hidden_size
        bias = getattr(config, "attention_bias", False)
        attention = self.self_attn
        attention.q_proj = nn.Linear(wide, config.num_attention_heads * head_dim, bias=bias)
        attention.k_proj = nn.Linear(wide, config.num_key_value_heads * head_dim, bias=bias)
        attention.v_proj = nn.Linear(wide, config.num_key_value_heads * head_dim, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        cache_position: torch.LongTensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        attention_input, residual = maybe_compiled(_attention_inputs, self.compile_blocks)(
            self, hidden_states
        )
        attended, _ = self.self_attn(
            hidden_states=attention_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        finish = maybe_compiled(_residual_mlp, self.compile_blocks)
        if self.recompute_mlp and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(
                finish, self, residual, attended, hidden_states.dtype, use_reentrant=False
            )
        return finish(self, residual, attended, hidden_states.dtype)


class ModelComponents(NamedTuple):
    first_layer_class: type
    decoder_layer_class: type
    norm_class: type
    rotary_emb_class: type


model_classes: dict[str, ModelComponents] = {
    "llama": ModelComponents(
        LlamaDecoderEagle3FirstLayer, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
    ),
}
