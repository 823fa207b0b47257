"""Regeneration's engine on the hidden-states generator: `datagen --regenerate` loads the target
once, answers the turns with it (capture paused), then extracts with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from speculators_vllm016.data_generation.engine_sampling import sample_responses
from speculators_vllm016.data_generation.regeneration.engines import (
    TurnRequest,
    TurnResponse,
    response_token_ids,
)
from speculators_vllm016.data_generation.regeneration.local_engine import sampling_params
from speculators_vllm016.data_generation.regeneration.options import SamplingOptions

__all__ = ["GeneratorEngine"]


class GeneratorEngine:
    """A `ResponseEngine` over a started `VllmHiddenStatesGenerator` (use it in `capture_paused`)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.defaults = generator.vllm_config.model_config.get_diff_sampling_param()

    def respond(
        self, requests: Sequence[TurnRequest], sampling: SamplingOptions
    ) -> list[TurnResponse]:
        if not requests:
            return []
        params = [sampling_params(sampling, r.seed, self.defaults) for r in requests]
        prompts = [r.prompt_token_ids for r in requests]
        return [
            TurnResponse(response_token_ids(ids, reason), finish_reason=reason)
            for ids, reason in sample_responses(self.generator, prompts, params)
        ]

    def close(self) -> None:
        """The generator belongs to the caller."""
