"""EAGLE-3: a one-layer draft fed three fused target hidden states, trained with test-time steps."""

from speculators_vllm016.models.eagle3.config import Eagle3SpeculatorConfig
from speculators_vllm016.models.eagle3.core import Eagle3DraftModel

__all__ = ["Eagle3DraftModel", "Eagle3SpeculatorConfig"]
