"""vLLM 0.16's model class for MLA EAGLE-3 drafts (`architectures: ["Eagle3DeepseekV2ForCausalLM"]`).

vLLM has this class from 0.18 on; this is our own for 0.16, built from 0.16's DeepSeek pieces and
registered by the plugin under the draft's architecture name. (The plugin's *target* class of the
same Python name in `deepseek_eagle3` is another thing: it is what vLLM builds for a DeepSeek
target, registered under `DeepseekV2ForCausalLM`.)

One DeepSeek decoder layer whose attention reads `[input_layernorm(embeds) ; hidden_norm(h)]`
(twice the hidden width), a dense MLP, the final norm, a head over the draft vocabulary and `fc`
fusing the target's auxiliary states, as `speculators_vllm016.models.eagle3.mla_layer` trains it.
The attention is vLLM 0.16's own: `DeepseekV2MLAAttention` (vLLM's MLA kernels, latent KV cache of
`kv_lora_rank + qk_rope_head_dim` values per token) when the model config uses MLA, which is the
GPU case; `DeepseekV2Attention` (plain attention over expanded keys and values) where MLA is off,
as on the CPU build with `VLLM_MLA_DISABLE=1`, which is also what the DeepSeek target then runs.
0.16's attention classes take one width for their input and their output; the draft's input is
twice its output, so the class is built for the input width and its output projection replaced
by one back to the hidden size (in the MLA wrapper too, which calls it).

Imported only by vLLM's model registry (the plugin registers a "module:Class" string).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2MLAAttention,
    DeepseekV2MLP,
)
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import process_eagle_weight

__all__ = ["MLAEagle3DraftForCausalLM", "MLAEagle3DraftModel"]

# checkpoint name part -> (vLLM parameter name part, shard); vLLM fuses these projections.
_STACKED = (
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_STACKED_MLA = (
    (".q_a_proj.", ".fused_qkv_a_proj.", 0),
    (".kv_a_proj_with_mqa.", ".fused_qkv_a_proj.", 1),
)


def _draft_attention(vllm_config: VllmConfig, config, use_mla: bool, prefix: str) -> nn.Module:
    """vLLM 0.16's DeepSeek attention reading `2 * hidden_size` and writing `hidden_size`."""
    config = copy.copy(config)  # the attention rewrites `rope_parameters["rope_type"]`
    scaling = getattr(config, "rope_scaling", None)
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if scaling:
        parameters = {**parameters, **scaling, "rope_type": "deepseek_yarn"}
    parameters.setdefault("rope_type", "default")
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    config.rope_parameters = parameters
    hidden = config.hidden_size
    attention_class = DeepseekV2MLAAttention if use_mla else DeepseekV2Attention
    attention = attention_class(
        vllm_config=vllm_config,
        config=config,
        hidden_size=2 * hidden,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=getattr(config, "q_lora_rank", None),
        kv_lora_rank=config.kv_lora_rank,
        max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
        cache_config=vllm_config.cache_config,
        quant_config=None,
        prefix=f"{prefix}.self_attn",
    )
    attention.o_proj = RowParallelLinear(
        config.num_attention_heads * config.v_head_dim,
        hidden,
        bias=False,
        prefix=f"{prefix}.self_attn.o_proj",
    )
    if use_mla:
        attention.mla_attn.o_proj = attention.o_proj
    return attention


class _DraftLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, config, use_mla: bool, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = _draft_attention(vllm_config, config, use_mla, prefix)
        self.mlp = DeepseekV2MLP(
            hidden_size=hidden,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attended = self.self_attn(positions=positions, hidden_states=x, llama_4_scaling=None)
        hidden_states, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "input_embeds": 0}
)
class MLAEagle3DraftModel(nn.Module):
    """Embeddings, `fc`, the one MLA layer and the final norm (parameters under `model.`)."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = ""):
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config
        use_mla = vllm_config.speculative_config.draft_model_config.use_mla
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        if int(getattr(config, "num_hidden_layers", 1)) != 1:
            raise ValueError("speculators' MLA EAGLE-3 draft class serves one-layer drafts")
        # The attention layer's name must differ from the target's layers' (0..N-1).
        self.layers = nn.ModuleList(
            [_DraftLayer(vllm_config, config, use_mla, f"{prefix}.layers.{start_layer_id}")]
        )
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = ReplicatedLinear(
            3 * target_hidden,
            config.hidden_size,
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            prefix=f"{prefix}.fc",
            return_bias=False,
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_embeds is None:
            input_embeds = self.embed_input_ids(input_ids)
        hidden_states, residual = self.layers[0](positions, input_embeds, hidden_states)
        normed, prenorm = self.norm(hidden_states, residual)
        return normed, prenorm


class MLAEagle3DraftForCausalLM(Eagle3LlamaForCausalLM):
    """What vLLM 0.16 builds for an `Eagle3DeepseekV2ForCausalLM` draft (the EAGLE-3 proposer's
    calls: `combine_hidden_states`, `forward`, `compute_logits`, `embed_input_ids`).

    A subclass of vLLM's Llama EAGLE-3 draft only because 0.16's proposer asserts that its
    EAGLE-3 model is one (`v1/spec_decode/eagle.py`); every method it calls is this class's own
    and none of the Llama class's `__init__` runs."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.use_mla = vllm_config.speculative_config.draft_model_config.use_mla
        self.model = MLAEagle3DraftModel(
            vllm_config=vllm_config, start_layer_id=target_layers, prefix="model"
        )
        self.lm_head = ParallelLMHead(
            self.config.draft_vocab_size, self.config.hidden_size, prefix="lm_head"
        )
        self.logits_processor = LogitsProcessor(self.config.draft_vocab_size)
        self.draft_id_to_target_id = nn.Parameter(
            torch.zeros(self.config.draft_vocab_size, dtype=torch.long), requires_grad=False
        )

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.fc(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Draft logits placed at their target ids (-inf elsewhere), as vLLM's EAGLE-3 drafts."""
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None:
            return None
        ids = torch.arange(self.config.draft_vocab_size, device=logits.device)
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, ids + self.draft_id_to_target_id] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Our checkpoint names (`layers.0.`, `fc`, `norm`, `lm_head`, `d2t`, `embed_tokens`) and
        TorchSpec's (`midlayer.`); `t2d` is not needed. A draft without `embed_tokens` or `d2t`
        gets the target's embeddings (vLLM shares them) and the identity map."""
        params = dict(self.named_parameters())
        stacked = _STACKED + (_STACKED_MLA if self.use_mla else ())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "t2d" or name.endswith(".t2d"):
                continue
            name = re.sub(r"^midlayer\.", "layers.0.", name)
            if name == "d2t":
                name = "draft_id_to_target_id"
            elif not name.startswith("lm_head."):
                name = "model." + name
            process_eagle_weight(self, name)
            for part, fused, shard in stacked:
                if part in name:
                    fused_name = name.replace(part, fused)
                    param = params[fused_name]
                    param.weight_loader(param, tensor, shard)
                    loaded.add(fused_name)
                    break
            else:
                if name not in params:
                    raise KeyError(f"the MLA draft has no parameter for checkpoint tensor {name}")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        # Shared from the target / identity when the checkpoint leaves them out.
        return loaded | {"model.embed_tokens.weight", "draft_id_to_target_id"}
