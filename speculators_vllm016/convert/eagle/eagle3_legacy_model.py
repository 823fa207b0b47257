"""0.3.0's stand-alone EAGLE-3 draft (`Eagle3Speculator`), kept for code that imports it.

0.3.0 used it to write converted EAGLE-3 checkpoints. Its weights have the names and shapes
`Eagle3DraftModel` saves (`embed_tokens`, `fc`, `layers.0.*` with `hidden_norm`, `norm`,
`lm_head`, `d2t`, `t2d`), so either class reads the other's folders and vLLM reads both. It is
not registered: `SpeculatorModel.from_pretrained` on an EAGLE-3 folder gives `Eagle3DraftModel`.
Unlike 0.3.0's, `forward` works: one draft step, logits over the draft vocabulary.
"""

from __future__ import annotations

import os
from typing import ClassVar, Literal

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle import causal_attention_mask
from speculators_vllm016.models.eagle3.config import Eagle3SpeculatorConfig
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["Eagle3Speculator"]

KeyValue = tuple[torch.Tensor, torch.Tensor]


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Eagle3Attention(nn.Module):
    """Self-attention whose queries, keys and values project from `[embedding ; hidden]` (2H)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads or config.num_attention_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = _head_dim(config)
        bias = getattr(config, "attention_bias", False)
        wide = 2 * self.hidden_size
        self.q_proj = nn.Linear(wide, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(wide, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(wide, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_value: KeyValue | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
        position_embeddings: KeyValue | None = None,
        **kwargs,
    ) -> tuple:
        """`(output [B, L, H], attention weights or None, (keys, values) or None)`.

        `attention_mask` is additive, `[B, 1, L, past + L]`; `past_key_value` holds the keys and
        values of earlier positions (before the key/value heads are repeated).
        """
        batch, length, _ = hidden_states.shape

        def heads(projection: nn.Linear, count: int) -> torch.Tensor:
            return (
                projection(hidden_states).view(batch, length, count, self.head_dim).transpose(1, 2)
            )

        query = heads(self.q_proj, self.num_heads)
        key = heads(self.k_proj, self.num_key_value_heads)
        value = heads(self.v_proj, self.num_key_value_heads)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_value is not None:
            key = torch.cat([past_key_value[0], key], dim=2)
            value = torch.cat([past_key_value[1], value], dim=2)
        present = (key, value) if use_cache else None
        key = repeat_kv(key, self.num_key_value_groups)
        value = repeat_kv(value, self.num_key_value_groups)
        scores = query @ key.transpose(2, 3) * self.head_dim**-0.5
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        output = (weights @ value).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(output), (weights if output_attentions else None), present


class Eagle3DecoderLayer(nn.Module):
    """The draft's decoder layer: the embedding half and the hidden half are normed apart
    (`input_layernorm`, `hidden_norm`), attended together, and the hidden half is the residual."""

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, norm_before_residual: bool = False
    ):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, layer_idx)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_value: KeyValue | None = None,
        output_attentions: bool | None = False,
        use_cache: bool | None = False,
        cache_position: torch.LongTensor | None = None,
        position_embeddings: KeyValue | None = None,
        **kwargs,
    ) -> tuple:
        """`hidden_states` is `[B, L, 2H]`: token embeddings, then fused target states.

        Returns `(hidden [B, L, H],)`, then the attention weights if `output_attentions`, then
        the `(keys, values)` if `use_cache`.
        """
        embeds, hidden = hidden_states.split(self.hidden_size, dim=-1)
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        attention_input = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        attended, weights, present = self.self_attn(
            attention_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=bool(output_attentions),
            use_cache=bool(use_cache),
            position_embeddings=position_embeddings,
        )
        hidden = residual + attended
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        outputs: tuple = (hidden,)
        if output_attentions:
            outputs += (weights,)
        if use_cache:
            outputs += (present,)
        return outputs


class Eagle3Speculator(SpeculatorModel):
    """EAGLE-3 draft as 0.3.0's converter built it: fuse three target states, one layer, draft head.

    `reduce_vocab_size` adds the `d2t` / `t2d` vocabulary maps; `has_drafter_embedding` gives the
    draft its own `embed_tokens` (needed by `forward`).
    """

    config_class: ClassVar[type[Eagle3SpeculatorConfig]] = Eagle3SpeculatorConfig  # type: ignore[misc]
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = [r"verifier\..*"]  # type: ignore[misc]
    _keys_to_ignore_on_save: ClassVar[list[str]] = []  # type: ignore[misc]

    def __init__(
        self,
        config: Eagle3SpeculatorConfig,
        verifier: str | os.PathLike | PreTrainedModel | None = None,
        verifier_attachment_mode: Literal["detached", "full", "train_only"] | None = None,
        reduce_vocab_size: bool = True,
        has_drafter_embedding: bool = True,
    ):
        if not isinstance(config, Eagle3SpeculatorConfig):
            raise InvalidInputError(
                f"config must be an Eagle3SpeculatorConfig, got {type(config).__name__}"
            )
        super().__init__(
            config=config, verifier=verifier, verifier_attachment_mode=verifier_attachment_mode
        )
        layer_config = config.transformer_layer_config
        self.hidden_size = layer_config.hidden_size
        self.draft_vocab_size = config.draft_vocab_size
        self.target_vocab_size = config.target_vocab_size
        self.target_hidden_size = config.target_hidden_size or self.hidden_size
        if has_drafter_embedding:
            self.embed_tokens = nn.Embedding(
                self.target_vocab_size,
                self.hidden_size,
                padding_idx=getattr(layer_config, "pad_token_id", None),
            )
        self.fc = nn.Linear(3 * self.target_hidden_size, self.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3DecoderLayer(layer_config, 0, norm_before_residual=config.norm_before_residual)]
        )
        self.norm = LlamaRMSNorm(self.hidden_size, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(self.hidden_size, self.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=layer_config)  # no weights
        if reduce_vocab_size:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.target_vocab_size, dtype=torch.bool))
        self.post_init()

    def tie_weights(self, *args, **kwargs):
        """Never tie: the embeddings cover the target vocabulary, the head the draft's."""

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.FloatTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: tuple[tuple[torch.FloatTensor]] | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> torch.FloatTensor | CausalLMOutputWithPast:
        """Draft-vocabulary logits `[B, L, draft_vocab]` for one draft step.

        `hidden_states` `[B, L, 3 * target_hidden]` are the three fused target states paired with
        `input_ids` `[B, L]` (target ids). `attention_mask` is a `[B, past + L]` padding mask.
        `past_key_values` is the `((keys, values),)` this method returned with `use_cache`.
        """
        embed = getattr(self, "embed_tokens", None)
        if embed is None:
            raise InvalidInputError(
                "this draft was built without embed_tokens (has_drafter_embedding)"
            )
        if hidden_states.shape[:2] != input_ids.shape:
            raise InvalidInputError(
                f"hidden_states {list(hidden_states.shape)} do not pair with input_ids "
                f"{list(input_ids.shape)}"
            )
        if return_dict is None:
            return_dict = self.config.use_return_dict
        batch, length = input_ids.shape
        past = past_key_values[0] if past_key_values else None
        past_length = past[0].shape[2] if past is not None else 0
        fused = self.fc(hidden_states.to(self.fc.weight.dtype))
        layer_input = torch.cat([embed(input_ids).to(fused.dtype), fused], dim=-1)
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=fused.device)
            position_ids = position_ids.unsqueeze(0).expand(batch, -1)
        mask = causal_attention_mask(
            attention_mask, batch, length, past_length, fused.dtype, fused.device
        )
        outputs = self.layers[0](
            layer_input,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_value=past,
            output_attentions=output_attentions,
            use_cache=use_cache,
            position_embeddings=self.rotary_emb(fused, position_ids),
        )
        logits = self.lm_head(self.norm(outputs[0]))
        if not return_dict:
            return logits
        return CausalLMOutputWithPast(
            logits=logits,
            past_key_values=(outputs[-1],) if use_cache else None,
            attentions=(outputs[1],) if output_attentions else None,
        )
