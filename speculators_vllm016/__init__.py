"""speculators-vllm016: EAGLE-style draft training data and models, native to vLLM 0.16.

A drop-in replacement for `speculators` 0.3.0: the public names live at the same paths, and
`import speculators` resolves to this package. As in 0.3.0, importing the package fills the
config and model registries, so dicts validate into the registered classes from the start.
"""

from __future__ import annotations

from speculators_vllm016.version import __version__
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

reload_and_populate_configs()
reload_and_populate_models()
