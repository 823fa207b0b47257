"""The draft's rotary settings per RoPE family (pure; vLLM's rotary modules, no engine). That
vLLM serves them as the trainer computes them: tests/vllm_compat/test_draft_positions.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from speculators_vllm016.utils.draft_positions import draft_positions


def _text(scaling, theta=10000.0, max_positions=1024, **extra):
    return SimpleNamespace(
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_positions, **extra
    )


def test_dynamic_ntk_becomes_the_base_vllm_serves_the_target_with():
    """vLLM fixes dynamic NTK's stretched base for every position; the draft's plain RoPE with
    that base is the same rotation at every position vLLM serves."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    head_dim = 32
    positions = draft_positions(_text({"rope_type": "dynamic", "factor": 2.0}), head_dim)
    assert positions.rope_scaling is None and positions.max_position_embeddings == 2048
    with set_current_vllm_config(VllmConfig()):
        target = get_rope(
            head_dim,
            1024,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            dtype=torch.float32,
        )
        draft = get_rope(
            head_dim,
            positions.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": positions.rope_theta},
            dtype=torch.float32,
        )
    torch.testing.assert_close(draft.cos_sin_cache, target.cos_sin_cache)


def test_plain_forms_stay_plain():
    """M-RoPE on text, a factor of 1, and no scaling are plain RoPE in both libraries."""
    for scaling in (
        None,
        {"type": "mrope", "mrope_section": [16, 24, 24]},
        {"rope_type": "default", "mrope_section": [16, 24, 24], "mrope_interleaved": True},
        {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 1024},
    ):
        positions = draft_positions(_text(scaling, theta=5e6), 32)
        assert positions.rope_scaling is None and positions.rope_theta == 5e6, scaling


def test_theta_is_read_from_rope_parameters_when_the_config_keeps_it_there():
    text = SimpleNamespace(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0},
        max_position_embeddings=512,
    )
    positions = draft_positions(text, 32)
    assert positions.rope_theta == 123.0
    assert positions.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_a_family_neither_library_reads_alike_gets_plain_rope_and_a_warning(caplog):
    scaling = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    with caplog.at_level(logging.WARNING):
        positions = draft_positions(_text(scaling), 32)
    assert positions.rope_scaling is None
    assert "longrope" in caplog.text
