"""Convert research checkpoints (EAGLE-1/2, HASS, EAGLE-3 releases) into speculator folders.

A speculator folder is `config.json` (with `speculators_config`) + `model.safetensors`, the layout
this library loads and vLLM reads for speculative decoding.
"""

from speculators_vllm016.convert.entrypoints import convert_model

__all__ = ["convert_model"]
