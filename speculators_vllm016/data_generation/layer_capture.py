"""Where a model keeps its decoder layers, and what a layer's output means as a residual stream.

Pure model-structure logic, shared by the worker extension (which hooks the layers vLLM built) and
the tests (which check discovery on every architecture without starting an engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "DecoderLayers",
    "UnsupportedModelError",
    "find_decoder_layers",
    "residual_stream",
    "residual_scale",
]

# Names under which Hugging Face style and vLLM models keep their stack of decoder blocks.
_LAYER_LIST_NAMES = ("layers", "h", "blocks", "decoder_layers")


class UnsupportedModelError(InvalidInputError):
    """The model's structure does not let hidden states be captured."""


@dataclass(frozen=True)
class DecoderLayers:
    """The decoder-layer list of a model and which of its entries this process holds."""

    path: str
    layers: nn.ModuleList
    owned: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.layers)


def _is_placeholder(module: nn.Module) -> bool:
    # vLLM fills the layers of other pipeline stages with PPMissingLayer (an Identity subclass).
    return type(module).__name__ == "PPMissingLayer" or isinstance(module, nn.Identity)


def find_decoder_layers(model: nn.Module, num_hidden_layers: int) -> DecoderLayers:
    """Find the `nn.ModuleList` holding the model's `num_hidden_layers` decoder layers.

    Works through wrappers (a multimodal model keeping its language model one level deeper, as
    Kimi-K2.5 does) by searching the module tree rather than assuming `model.model.layers`.
    """
    modules = dict(model.named_modules())
    candidates: list[tuple[str, nn.ModuleList]] = []
    for name, module in modules.items():
        if not isinstance(module, nn.ModuleList) or len(module) != num_hidden_layers:
            continue
        if name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES:
            candidates.append((name, module))
    if not candidates:
        lists = [
            f"{name} ({len(module)})"
            for name, module in modules.items()
            if isinstance(module, nn.ModuleList)
        ]
        raise UnsupportedModelError(
            f"Cannot capture hidden states from {type(model).__name__}: no module list named "
            f"{'/'.join(_LAYER_LIST_NAMES)} holds its {num_hidden_layers} decoder layers "
            f"(module lists found: {', '.join(lists) or 'none'})."
        )

    def rank(candidate: tuple[str, nn.ModuleList]) -> tuple[int, int, int]:
        # The language model's stack sits beside its token embedding; towers nested elsewhere
        # (vision encoders, MTP heads) do not. Then prefer "layers", then the shallowest.
        name = candidate[0]
        parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        beside_embedding = parent is not None and hasattr(parent, "embed_tokens")
        return (
            0 if beside_embedding else 1,
            _LAYER_LIST_NAMES.index(name.rsplit(".", 1)[-1]),
            name.count("."),
        )

    path, layers = min(candidates, key=rank)
    owned = tuple(i for i, layer in enumerate(layers) if not _is_placeholder(layer))
    return DecoderLayers(path=path, layers=layers, owned=owned)


def residual_stream(output: object) -> torch.Tensor:
    """The residual stream after a decoder layer, from what the layer's forward returned.

    vLLM decoder layers defer the last residual add: they return `(hidden_states, residual)` and the
    stream is their sum. Layers that return a single tensor already hold the stream.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        if len(output) >= 2 and isinstance(output[1], torch.Tensor):
            return output[0] + output[1]
        return output[0]
    raise UnsupportedModelError(
        f"A decoder layer returned {type(output).__name__}; expected a tensor or a "
        "(hidden_states, residual) tuple."
    )


def residual_scale(layer: nn.Module, dtype: torch.dtype) -> float:
    """Factor that turns what the layer returns back into the true residual stream.

    In float16, vLLM's DeepSeek-V2/V3 layers divide hidden states and residual by
    `routed_scaling_factor` from layer 0 on to avoid overflow (the final RMSNorm does not see it);
    every captured DeepSeek layer must be multiplied back.
    """
    if dtype != torch.float16 or type(layer).__name__ != "DeepseekV2DecoderLayer":
        return 1.0
    attention = getattr(layer, "self_attn", None)
    if attention is not None and type(attention).__name__ == "DeepseekAttention":
        return 1.0  # the plain-attention DeepSeek (v1) path does not rescale
    return float(getattr(layer, "routed_scaling_factor", 1.0))
