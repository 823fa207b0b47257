"""Offline data generation: target-model hidden states for draft training."""

from __future__ import annotations

from typing import Any

__all__ = ["VllmHiddenStatesGenerator"]


def __getattr__(name: str) -> Any:
    # The generator imports vLLM; load it only when asked for, so preprocessing stays light.
    if name == "VllmHiddenStatesGenerator":
        from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
            VllmHiddenStatesGenerator,
        )

        return VllmHiddenStatesGenerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
