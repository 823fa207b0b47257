"""speculators-vllm016: EAGLE-style draft training data and models, native to vLLM 0.16.

A drop-in replacement for `speculators` 0.3.0: the public names live at the same paths, and
`import speculators` resolves to this package. The names below are imported on first use (PEP
562), so `speculators <command> --help` starts without torch or transformers; the config and
model registries are filled when the first of them is asked for (and each registry imports
its built-in classes at its first look-up in any case).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from speculators_vllm016.version import __version__

if TYPE_CHECKING:
    from speculators_vllm016.config import (
        SpeculatorModelConfig,
        SpeculatorsConfig,
        TokenProposalConfig,
        VerifierConfig,
        reload_and_populate_configs,
    )
    from speculators_vllm016.model import SpeculatorModel, reload_and_populate_models

__all__ = [
    "SpeculatorModel",
    "SpeculatorModelConfig",
    "SpeculatorsConfig",
    "TokenProposalConfig",
    "VerifierConfig",
    "__version__",
    "reload_and_populate_configs",
    "reload_and_populate_models",
]

_HOMES = {
    "SpeculatorModelConfig": "config",
    "SpeculatorsConfig": "config",
    "TokenProposalConfig": "config",
    "VerifierConfig": "config",
    "reload_and_populate_configs": "config",
    "SpeculatorModel": "model",
    "reload_and_populate_models": "model",
}


def _populate_registries() -> None:
    """What `import speculators` did at once in 0.3.0, done at the first public name asked for
    (config and model first, then their built-in classes: they import both)."""
    config = importlib.import_module(f"{__name__}.config")
    model = importlib.import_module(f"{__name__}.model")
    config.reload_and_populate_configs()
    model.reload_and_populate_models()


def __getattr__(name: str) -> Any:
    """The public names of 0.3.0's package, imported when first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _populate_registries()
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
