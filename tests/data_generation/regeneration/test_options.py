"""The engine context regeneration asks for, against the model's (`refuse_beyond_model_context`):
regeneration's own engine gets no position past the model's context; datagen's one-pass engine
(`--regenerate`) gets one, where the token sampled after a sample of the whole context sits."""

from __future__ import annotations

import pytest

from speculators_vllm016.data_generation.regeneration.options import refuse_beyond_model_context
from speculators_vllm016.utils.errors import InvalidInputError

CONFIG = {"max_position_embeddings": 1024}


def test_regenerations_engine_stays_within_the_models_context():
    refuse_beyond_model_context(1024, CONFIG)
    with pytest.raises(
        InvalidInputError, match="context of 1025 tokens .* longer than the model's"
    ):
        refuse_beyond_model_context(1025, CONFIG)


def test_the_one_pass_engine_may_hold_one_position_more():
    refuse_beyond_model_context(1025, CONFIG, spare=1)  # datagen --seq-length 1024 --regenerate
    with pytest.raises(InvalidInputError, match="context of 1026 tokens"):
        refuse_beyond_model_context(1026, CONFIG, spare=1)


def test_rope_scaling_leaves_the_check_to_vllm():
    refuse_beyond_model_context(4096, {**CONFIG, "rope_scaling": {"factor": 4.0}})
