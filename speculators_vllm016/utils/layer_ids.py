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

__all__ = ["datagen_to_vllm_layer_ids", "default_layer_ids", "eagle3_aux_layer_ids"]


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
