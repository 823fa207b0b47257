"""The MLA decoder layer of the EAGLE-3 draft: one DeepSeek-V2/V3 layer (multi-head latent
attention and a dense SiLU MLP) whose attention reads `[token embedding ; fused hidden state]`.

Why a DeepSeek layer: a Kimi-K2.5 / DeepSeek-V3 target keeps 576 values of KV cache per token and
layer (the 512-wide compressed latent and the 64-wide shared rotary key); a Llama-layer draft of
the same width keeps 2 x 64 x 128 = 16,384. On a target that already fills its GPUs this is what
makes the draft cheap to serve, and it is what the MLA drafts vLLM >= 0.18 and TorchSpec serve and
publish are built from.

The module names are DeepSeek's (`self_attn.q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, ...,
`mlp.gate_proj`), so the draft's state dict is already the layout vLLM's
`Eagle3DeepseekV2ForCausalLM` loads (`layers.0.` for the layer, `fc`, `norm`, `lm_head`, `d2t`).

Numerics follow vLLM's DeepSeek attention: rotary embedding on the last `qk_rope_head_dim`
dimensions of queries and of the one shared key, in the interleaved-pair (GPT-J) convention; the
softmax scale `qk_head_dim ** -0.5`, times `mscale ** 2` under YaRN scaling. Training runs the
expanded (non-absorbed) form: the same function vLLM's MLA kernels compute with absorbed weights.

The layer takes the Llama first layer's call (`LlamaDecoderEagle3FirstLayer`): the draft model
runs either through `run_layers` unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from speculators_vllm016.models.eagle3.attention import flex_attention_forward
from speculators_vllm016.models.eagle3.model_definitions import (
    ModelComponents,
    _rotary,
    _spread,
    model_classes,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "MLA_LAYER_TYPES",
    "DeepseekEagle3FirstLayer",
    "Eagle3MLAttention",
    "Eagle3MLP",
    "mla_softmax_scale",
]

# The layer-config model type the MLA layer builds from (transformers' name). Kimi-K2 and
# DeepSeek-V2 layers are the same layer: their drafts are read as `deepseek_v3` layer configs.
MLA_LAYER_TYPES = ("deepseek_v3",)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN attention-magnitude correction (1 for no scaling)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """The attention's softmax scale as vLLM's DeepSeek layers compute it: `qk_head_dim ** -0.5`,
    times `mscale(factor, mscale_all_dim) ** 2` when the config has RoPE scaling."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        mscale = _yarn_mscale(float(scaling["factor"]), float(scaling.get("mscale_all_dim") or 0))
        scale *= mscale * mscale
    return scale


def _pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """`[..., (d/2, 2)]` interleaved pairs regrouped as `[..., (2, d/2)]` halves.

    The rotation of pair (2i, 2i+1) by angle i is then the half-split rotation of dims i and
    i + d/2; queries and keys are regrouped alike, so their dot products are the
    interleaved-convention ones vLLM computes.
    """
    shape = x.shape
    return x.view(*shape[:-1], shape[-1] // 2, 2).transpose(-1, -2).reshape(shape)


class Eagle3MLAttention(nn.Module):
    """Multi-head latent attention over an input `input_size` wide (twice the hidden size in the
    first EAGLE-3 layer). Queries through a low-rank `q_a_proj` -> norm -> `q_b_proj` (or one
    `q_proj` without `q_lora_rank`); keys and values through the compressed latent
    (`kv_a_proj_with_mqa` -> `kv_a_layernorm` -> `kv_b_proj`) plus one rotary key shared by every
    head."""

    def __init__(self, config: Any, input_size: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.scaling = mla_softmax_scale(config)
        self.attention_dropout = 0.0
        self.is_causal = False  # the masks are the draft's
        heads = self.num_heads
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(input_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = LlamaRMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(input_size, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            input_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * self.v_head_dim, config.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values `[B, L, heads, D]` of `x` `[B, L, input_size]` (rotary applied;
        keys and queries `qk_head_dim` wide, values `v_head_dim`)."""
        batch, length = x.shape[:2]
        heads = self.num_heads
        if self.q_lora_rank:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            query = self.q_proj(x)
        query = query.view(batch, length, heads, self.qk_head_dim)
        q_nope, q_rope = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, length, heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q_rope, k_rope = _rotary(
            _pairs_to_halves(q_rope),
            _pairs_to_halves(k_rope.view(batch, length, 1, self.qk_rope_head_dim)),
            cos.to(q_rope.dtype),
            sin.to(q_rope.dtype),
        )
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        return query, key, value

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention output `[B, L, heads * v_head_dim]` of `[B, L, heads, D]` inputs, the keys
        and values appended to `past_key_values` (the TTT steps' cache) first."""
        batch, length = query.shape[:2]
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        # The draft's masks (a flex `BlockMask` or a dense boolean one) are what this reads.
        attended, _ = flex_attention_forward(
            self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return attended.reshape(batch, length, -1)


class Eagle3MLP(nn.Module):
    """DeepSeek's dense MLP: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        if config.hidden_act not in ("silu", "swish"):
            raise InvalidInputError(
                f"the MLA draft's MLP supports hidden_act 'silu', got {config.hidden_act!r}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _NoWeightCache:
    """The MLA layer casts through autocast; it keeps no per-pass weight copies."""


class DeepseekEagle3FirstLayer(nn.Module):
    """A DeepSeek decoder layer whose attention reads `[input_layernorm(embeds) ;
    hidden_norm(hidden)]`; the residual is the hidden half (normalized first when
    `norm_before_residual`), as in vLLM's MLA EAGLE-3 draft.

    `positions` (the output rows the caller reads) zeroes the other rows of the output; the
    layer computes every row (its keys are needed by later steps anyway), so the option saves
    nothing here but keeps the call the Llama layer's.
    """

    def __init__(self, config: Any, layer_idx: int = 0, norm_before_residual: bool = False):
        super().__init__()
        if layer_idx != 0:
            raise InvalidInputError("the MLA draft has one decoder layer (num_hidden_layers=1)")
        self.norm_before_residual = norm_before_residual
        self.compile_blocks = False
        self.recompute_mlp = False
        eps = config.rms_norm_eps
        self.self_attn = Eagle3MLAttention(config, 2 * config.hidden_size, layer_idx)
        self.mlp = Eagle3MLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)

    def compute_weights(self, dtype: torch.dtype | None) -> _NoWeightCache:
        """The draft's per-pass weight cache asks every first layer for one; autocast casts here."""
        return _NoWeightCache()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Any = None,
        input_embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        weight_cache: Any = None,
        keys_everywhere: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One TTT step over `[B, L, H]` hidden states beside `input_embeds` (or over
        `[embeds ; hidden]` concatenated); returns `[B, L, H]` (the pre-norm output)."""
        if position_embeddings is None:
            raise InvalidInputError("the EAGLE-3 layer needs position_embeddings (cos, sin)")
        if input_embeds is None:
            embeds, hidden = hidden_states.chunk(2, dim=-1)
        else:
            embeds, hidden = input_embeds, hidden_states
        dtype = hidden.dtype
        embeds = embeds.to(dtype)
        normed_hidden = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        cos, sin = position_embeddings
        query, key, value = self.self_attn.project(x, cos, sin)
        attended = self.self_attn.attend(
            query, key, value, attention_mask, past_key_values=past_key_values, **kwargs
        )
        attended = self.self_attn.o_proj(attended)
        residual = normed_hidden if self.norm_before_residual else hidden
        mlp_input = residual + attended
        output = (mlp_input + self.mlp(self.post_attention_layernorm(mlp_input))).to(dtype)
        if positions is not None:
            output = _spread(output[:, positions], positions, output.shape[1])
        return output


class _OneLayerOnly(nn.Module):
    """Stands for the later layers an MLA draft does not have (see `DeepseekEagle3FirstLayer`)."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        raise InvalidInputError("the MLA draft has one decoder layer (num_hidden_layers=1)")


def _register() -> None:
    components = ModelComponents(
        DeepseekEagle3FirstLayer, _OneLayerOnly, LlamaRMSNorm, DeepseekV3RotaryEmbedding
    )
    for name in MLA_LAYER_TYPES:
        model_classes[name] = components


_register()
