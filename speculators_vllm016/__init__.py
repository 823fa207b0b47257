"""speculators-vllm016: EAGLE-style draft training data and models, native to vLLM 0.16.

A drop-in replacement for `speculators` 0.3.0: the public names live at the same paths, and
`import speculators` resolves to this package.
"""

from __future__ import annotations

import importlib
from typing import Any

from speculators_vllm016.version import __version__

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

# Heavy modules (torch, transformers, vllm) load on first use, so that `import speculators` and the
# command line stay fast.
_LAZY = {
    "SpeculatorModel": "speculators_vllm016.model",
    "reload_and_populate_models": "speculators_vllm016.model",
    "SpeculatorModelConfig": "speculators_vllm016.config",
    "SpeculatorsConfig": "speculators_vllm016.config",
    "TokenProposalConfig": "speculators_vllm016.config",
    "VerifierConfig": "speculators_vllm016.config",
    "reload_and_populate_configs": "speculators_vllm016.config",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'speculators_vllm016' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
