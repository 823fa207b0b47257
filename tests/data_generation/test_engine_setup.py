"""The extraction engine's vLLM config (`engine_setup.engine_config_of`; vLLM's own checks, no
worker is started): `datagen --seq-length N` on a target whose context is N tokens asks for
max_model_len N + 1 (vLLM keeps a prompt's last position for the sampled token), which vLLM
alone refuses. One position past the model's context is taken (only the sampled token sits
there, and no model runs it); two are refused in vLLM's own words."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from speculators_vllm016.data_generation.engine_setup import (
    EngineSettings,
    engine_args_of,
    engine_config_of,
)
from speculators_vllm016.data_generation.options import DatagenOptions

# The tiny Llama's max_position_embeddings (speculators_vllm016.tiny_models.build_tiny_llama).
CONTEXT = 1024


def _settings(model: Path, max_model_len: int) -> EngineSettings:
    return EngineSettings(
        model_path=str(model),
        layer_ids=None,
        max_model_len=max_model_len,
        gpu_memory_utilization=0.8,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=8192,
        trust_remote_code=False,
        enable_prefix_caching=False,
        transfer_root=None,
        max_transfer_bytes=None,
    )


def test_a_sample_of_the_models_whole_context_fits(tiny_llama, tmp_path):
    options = DatagenOptions(
        target_model_path=str(tiny_llama),
        train_data_path=str(tmp_path / "chats.jsonl"),
        output_dir=str(tmp_path / "out"),
        seq_length=CONTEXT,
    )
    asked = options.resolved_max_model_len
    assert asked == CONTEXT + 1
    before = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    config = engine_config_of(engine_args_of(_settings(tiny_llama, asked)))
    assert config.model_config.max_model_len == CONTEXT + 1
    assert os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == before, "vLLM's switch left set"


def test_more_than_one_position_past_the_context_is_refused_in_vllms_words(tiny_llama):
    with pytest.raises(
        ValueError,
        match=rf"User-specified max_model_len \({CONTEXT + 2}\) is greater than the derived "
        rf"max_model_len \(max_position_embeddings={CONTEXT}",
    ):
        engine_config_of(engine_args_of(_settings(tiny_llama, CONTEXT + 2)))
