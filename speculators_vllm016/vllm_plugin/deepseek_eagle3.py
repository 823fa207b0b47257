"""DeepSeek-V2/V3 (Kimi-K2) and Kimi-K2.5 model classes with vLLM's EAGLE-3 interface.

Imported only by vLLM's model registry when it builds one of these models (the plugin registers
them as "module:Class" strings), never by the package itself: it imports vLLM's model code.

The aux states are collected in the inner model's forward, as vLLM's Llama does, so they work
under `@support_torch_compile` (the subclass inherits the decorated `__init__`/`__call__`, and
vLLM compiles the subclass's own `forward`): the layer ids are set once when the GPU runner loads
the model, before the first (compiled) forward, and never change afterwards. Differences from
Llama's loop, each on purpose:
- ids are global layer indices (Llama counts from the stage's first layer), so a pipeline stage
  collects exactly the ids it runs;
- id 0 (the embeddings, no residual yet) and id N (the last layer's output, before the final
  norm) can be asked for as well;
- in float16 vLLM's DeepSeek layers divide the residual stream by `routed_scaling_factor`; the
  aux states are multiplied back so the draft sees the model's true stream in every dtype.
With pipeline parallelism only the last stage returns aux states (as Llama); vLLM 0.16's GPU
runner unpacks the pair on every stage, so EAGLE-3 there needs one pipeline stage.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV2Model,
    DeepseekV3ForCausalLM,
    _get_llama_4_scaling,
)
from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3
from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
from vllm.sequence import IntermediateTensors

from speculators_vllm016.data_generation.layer_capture import residual_scale
from speculators_vllm016.utils.errors import InvalidInputError, RunFailedError
from speculators_vllm016.utils.layer_ids import eagle3_aux_layer_ids

__all__ = [
    "Eagle3DeepseekV2ForCausalLM",
    "Eagle3DeepseekV2Model",
    "Eagle3DeepseekV3ForCausalLM",
    "Eagle3KimiK25ForConditionalGeneration",
]


class Eagle3DeepseekV2Model(DeepseekV2Model):
    """vLLM's DeepSeek-V2/V3 decoder stack that also returns the residual streams asked for."""

    aux_hidden_state_layers: tuple[int, ...] = ()
    # What turns vLLM's float16 stream back into the model's own (1.0 in bf16/fp32); set together
    # with the layers, so the (compiled) forward only multiplies by a constant.
    aux_stream_scale: float = 1.0

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if not self.aux_hidden_state_layers:
            # Not a zero-argument super(): vLLM swaps this function's code when compiled.
            return DeepseekV2Model.forward(
                self, input_ids, positions, intermediate_tensors, inputs_embeds
            )
        pp_group = get_pp_group()
        if pp_group.is_first_rank:
            hidden_states = (
                inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            )
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        scaling = getattr(self.config, "llama_4_scaling", None)
        llama_4_scaling = None
        if scaling is not None:
            llama_4_scaling = _get_llama_4_scaling(
                original_max_position_embeddings=scaling["original_max_position_embeddings"],
                scaling_beta=scaling["beta"],
                positions=positions,
            )
        scale = self.aux_stream_scale
        wanted = self.aux_hidden_state_layers
        aux_hidden_states: list[torch.Tensor] = []
        for index in range(self.start_layer, self.end_layer):
            if index in wanted:
                stream_scale = 1.0 if index == 0 else scale  # layer 0's input is the embedding
                aux_hidden_states.append(_stream(hidden_states, residual, stream_scale))
            hidden_states, residual = self.layers[index](
                positions, hidden_states, residual, llama_4_scaling
            )
        if self.end_layer in wanted and self.end_layer == len(self.layers):
            aux_hidden_states.append(_stream(hidden_states, residual, scale))
        if not pp_group.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, aux_hidden_states


def _stream(
    hidden_states: torch.Tensor, residual: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The residual stream between two layers (vLLM defers the add to the next layer's norm)."""
    stream = hidden_states if residual is None else hidden_states + residual
    return stream * scale if scale != 1.0 else stream


def _checked_layers(layers: Any, num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layers)
    wrong = [i for i in ids if not 0 <= i <= num_layers]
    if wrong:
        raise InvalidInputError(
            f"EAGLE-3 aux layer ids {wrong} are out of range for a target with {num_layers} "
            f"decoder layers (0..{num_layers}: id i is the input of layer i)"
        )
    return ids


class Eagle3DeepseekV2ForCausalLM(DeepseekV2ForCausalLM, SupportsEagle3):
    """`DeepseekV2ForCausalLM` with vLLM's EAGLE-3 interface."""

    model_cls = Eagle3DeepseekV2Model

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        model = self.model
        model.aux_hidden_state_layers = _checked_layers(layers, len(model.layers))
        dtype = model.vllm_config.model_config.dtype  # the activations' dtype
        model.aux_stream_scale = residual_scale(model.layers[model.start_layer], dtype)

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        # vLLM's default for Llama; a draft's config.json names its own layers and wins.
        return tuple(eagle3_aux_layer_ids(len(self.model.layers)))


class Eagle3DeepseekV3ForCausalLM(Eagle3DeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
    """`DeepseekV3ForCausalLM` (DeepSeek-V3, Kimi-K2) with vLLM's EAGLE-3 interface."""


class Eagle3KimiK25ForConditionalGeneration(KimiK25ForConditionalGeneration, SupportsEagle3):
    """Kimi-K2.5's multimodal wrapper passing the EAGLE-3 interface to its language model.

    vLLM builds the language model through its registry as `DeepseekV2ForCausalLM`, so with the
    plugin loaded it is `Eagle3DeepseekV2ForCausalLM`; the wrapper's forward already returns
    whatever the language model returns.
    """

    def __init__(self, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # vLLM 0.16's EAGLE proposer reads `config.image_token_index` of every multimodal target
        # as it loads the draft (`EagleProposer.load_model`); Kimi-K2.5's config names its media
        # token `media_placeholder_token_id` and has no such attribute, so loading a draft fails.
        config = self.config
        if not hasattr(config, "image_token_index"):
            config.image_token_index = config.media_placeholder_token_id

    def _eagle3_language_model(self) -> Eagle3DeepseekV2ForCausalLM:
        model = self.language_model
        if not supports_eagle3(model):
            raise RunFailedError(
                f"Kimi-K2.5's language model is {type(model).__name__}, which lacks EAGLE-3 "
                "support: the speculators plugin did not register its DeepSeek class here"
            )
        return model

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self._eagle3_language_model().set_aux_hidden_state_layers(layers)

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self._eagle3_language_model().get_eagle3_aux_hidden_state_layers()
