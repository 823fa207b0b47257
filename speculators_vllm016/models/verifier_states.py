"""The verifier's hidden states in vLLM's EAGLE-3 numbering, from a transformers forward.

A draft's `eagle_aux_hidden_state_layer_ids` number the residual stream: id i is the input of
decoder layer i, so id N (N decoder layers) is the last layer's output *before* the final norm.
That is what vLLM captures (the plugin's DeepSeek classes append `hidden_states + residual` after
the last layer), what datagen's layer hooks record and so what drafts are trained on, and it is
what a tool hooking "the output of layer N - 1" (ModelOpt, TorchSpec) captures too.

transformers' `output_hidden_states` agrees for ids 0..N-1, but its last entry is the final
norm's output (`check_model_inputs` ties it to `last_hidden_state`), so a draft fusing id N read
another state in the `hf` engine than the one it was trained on and is served with (it showed as
different acceptance counters on the tiny DeepSeek-V3). `ResidualStreamStates` hooks the last
decoder layer and puts its output back in that slot.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speculators_vllm016.data_generation.layer_capture import find_decoder_layers, residual_stream
from speculators_vllm016.utils.text_config import text_config_of

__all__ = ["ResidualStreamStates"]


class ResidualStreamStates:
    """Hooks the verifier's last decoder layer; `of(output)` is `output.hidden_states` with the
    last entry replaced by that layer's output (pre-norm). Use as a context manager, or call
    `close()`, so that the hook does not outlive the decoding run."""

    def __init__(self, verifier: nn.Module) -> None:
        layers = int(text_config_of(verifier.config).num_hidden_layers)
        last = find_decoder_layers(verifier, layers).layers[layers - 1]
        self._latest: torch.Tensor | None = None
        self._handle = last.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._latest = residual_stream(output)

    def of(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The hidden states of the forward that just ran, entry i the input of layer i."""
        if self._latest is None:
            raise RuntimeError("the verifier ran no forward since the states were read")
        states = tuple(output.hidden_states[:-1]) + (self._latest,)
        self._latest = None
        return states

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self) -> ResidualStreamStates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
