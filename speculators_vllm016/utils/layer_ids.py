"""Which target layers EAGLE-3 fuses by default: the one definition of those numbers."""

from __future__ import annotations

__all__ = ["default_layer_ids", "eagle3_aux_layer_ids"]


def eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """The three auxiliary layers of an `num_layers`-layer target: `[2, N // 2, N - 3]`.

    0.3.0 and vLLM 0.16 use these numbers; vLLM reads them as "input of decoder layer i", datagen
    as "output of decoder layer i".
    """
    return [2, num_layers // 2, num_layers - 3]


def default_layer_ids(num_layers: int) -> list[int]:
    """0.3.0's datagen default: the three auxiliary layers, then the last layer."""
    return [*eagle3_aux_layer_ids(num_layers), num_layers - 1]
