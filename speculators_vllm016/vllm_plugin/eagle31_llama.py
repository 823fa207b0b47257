"""vLLM 0.16's Llama-layer EAGLE-3 draft class with EAGLE-3.1's switches (served from 0.22 on).

Imported only by vLLM's model registry (the plugin registers it for the architecture names vLLM
0.16 maps to `Eagle3LlamaForCausalLM`: that one, which a speculators-format config always
resolves to, and `LlamaForCausalLMEagle3`), never by the package itself.

The switches are read from the draft's Hugging Face config under upstream speculators 0.7's
keys, which vLLM >= 0.22 reads too; `speculators_config.py` makes vLLM 0.16 copy them there from
a speculators-format `config.json` as later vLLM does:
- `norm_before_fc`: one RMSNorm over the concatenated aux states before `fc` (`input_norm`);
- `fc_norm`: one RMSNorm per aux state before `fc` (`fc_norm.<i>`);
- `norm_output`: the state handed to the next draft step is the final norm's output (the one the
  LM head reads) instead of the residual stream before it.
With all three off, this class builds the same parameters and runs the same computation as
vLLM's own class: no module is added and every method defers to it.

A checkpoint that asks for a norm it does not hold is refused when its weights load (vLLM's
loader would leave the norm at its initial ones without a word).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from speculators_vllm016.utils.eagle31 import normalize_aux_states
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["Eagle31LlamaForCausalLM"]

# vLLM 0.16's `LlamaModel` of the draft sizes `fc` for three aux states.
_AUX_STATES = 3


class Eagle31LlamaForCausalLM(Eagle3LlamaForCausalLM):
    """`Eagle3LlamaForCausalLM` plus `norm_before_fc`, `fc_norm` and `norm_output`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        self.norm_output = bool(getattr(config, "norm_output", False))
        norm_before_fc = bool(getattr(config, "norm_before_fc", False))
        fc_norm = bool(getattr(config, "fc_norm", False))
        if norm_before_fc and fc_norm:
            raise InvalidInputError("the draft's config sets both norm_before_fc and fc_norm")
        inner = self.model
        width = getattr(config, "target_hidden_size", None) or config.hidden_size
        eps = config.rms_norm_eps
        inner.input_norm = RMSNorm(_AUX_STATES * width, eps=eps) if norm_before_fc else None
        inner.fc_norm = (
            nn.ModuleList(RMSNorm(width, eps=eps) for _ in range(_AUX_STATES)) if fc_norm else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(what the LM head reads, what the next draft step reads)`."""
        normed, before_norm = super().forward(input_ids, positions, hidden_states, inputs_embeds)
        return normed, normed if self.norm_output else before_norm

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.model.use_aux_hidden_state:
            hidden_states = normalize_aux_states(
                hidden_states, self.model.input_norm, self.model.fc_norm
            )
        return super().combine_hidden_states(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's loading, then a check that every norm the config asks for was in the file."""
        names: set[str] = set()

        def seen() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                names.add(name)
                yield name, tensor

        result = super().load_weights(seen())
        wanted = [f"fc_norm.{index}.weight" for index in range(len(self.model.fc_norm or ()))] + (
            ["input_norm.weight"] if self.model.input_norm is not None else []
        )
        missing = [name for name in wanted if not any(n.endswith(name) for n in names)]
        if missing:
            raise InvalidInputError(
                f"the draft's config asks for {', '.join(missing)} but its weights hold none: "
                "a checkpoint saved without them cannot run as the config says"
            )
        return result
