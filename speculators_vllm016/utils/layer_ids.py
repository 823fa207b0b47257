"""Which target layers EAGLE-3 fuses, and the two numberings of a layer id.

Two conventions meet here, and this module is the one place that converts between them:
- datagen (and `data_config.json`'s `hidden_states.layer_ids`) numbers a captured state by the
  decoder layer that *outputs* it: id `i` is the output of layer `i` (0-based);
- vLLM's `eagle_aux_hidden_state_layer_ids` numbers it by the decoder layer that *reads* it as
  input: the output of layer `i` is the input of layer `i + 1`.
So a datagen id `i` is vLLM aux id `i + 1` (0.3.0's deviation D8 trained with `i` and served the
wrong layers).
"""

from __future__ import annotations

from collections.abc import Sequence

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "datagen_to_vllm_layer_ids",
    "default_layer_ids",
    "eagle3_aux_layer_ids",
    "normalize_layer_ids",
]


def eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """The three auxiliary layers of an `num_layers`-layer target: `[2, N // 2, N - 3]`.

    0.3.0 and vLLM 0.16 use these numbers; vLLM reads them as "input of decoder layer i", datagen
    as "output of decoder layer i".
    """
    return [2, num_layers // 2, num_layers - 3]


def default_layer_ids(num_layers: int) -> list[int]:
    """0.3.0's datagen default: the three auxiliary layers, then the last layer."""
    return [*eagle3_aux_layer_ids(num_layers), num_layers - 1]


def datagen_to_vllm_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """Datagen's ids ("output of layer i") as vLLM's aux ids ("input of layer i + 1").

    A draft's config stores vLLM's numbering (`eagle_aux_hidden_state_layer_ids`) so that vLLM
    serves it the very states it was trained on.
    """
    return [int(i) + 1 for i in layer_ids]


def normalize_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Resolve negative ids from the end and refuse ids out of range.

    A layer may appear twice (0.3.0's defaults repeat one on models of fewer than 6 layers); each
    occurrence gets its own copy in the output.
    """
    if len(layer_ids) == 0:
        raise InvalidInputError("layer_ids is empty: name at least one decoder layer to capture")
    resolved: list[int] = []
    for layer_id in layer_ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise InvalidInputError(f"layer id {layer_id!r} is not an integer")
        index = layer_id + num_layers if layer_id < 0 else layer_id
        if not 0 <= index < num_layers:
            raise InvalidInputError(
                f"layer id {layer_id} is out of range for a model with {num_layers} decoder "
                f"layers (valid: {-num_layers}..{num_layers - 1})"
            )
        resolved.append(index)
    return resolved
