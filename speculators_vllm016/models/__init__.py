"""Speculator model implementations and their configs."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Eagle3DraftModel",
    "Eagle3SpeculatorConfig",
    "EagleSpeculator",
    "EagleSpeculatorConfig",
    "IndependentSpeculatorConfig",
    "MLPSpeculatorConfig",
]

_LOCATIONS = {
    "Eagle3DraftModel": "speculators_vllm016.models.eagle3",
    "Eagle3SpeculatorConfig": "speculators_vllm016.models.eagle3",
    "EagleSpeculator": "speculators_vllm016.models.eagle",
    "EagleSpeculatorConfig": "speculators_vllm016.models.eagle",
    "IndependentSpeculatorConfig": "speculators_vllm016.models.independent",
    "MLPSpeculatorConfig": "speculators_vllm016.models.mlp",
}


def __getattr__(name: str) -> Any:
    # Lazy: registries import this package's modules one by one; names load on first use.
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
