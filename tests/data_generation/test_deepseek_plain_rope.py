"""DeepSeek-V3 with `rope_scaling: null` (plain RoPE) on vLLM's CPU build matches transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
    VllmHiddenStatesGenerator,
)
from tests.hf_reference import HFReference, assert_matches_reference, mixed_batch

pytestmark = pytest.mark.engine

LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def plain_rope_deepseek(tiny_deepseek_v3, tmp_path_factory) -> Path:
    folder = Path(shutil.copytree(tiny_deepseek_v3, tmp_path_factory.mktemp("ds") / "plain"))
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = None
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_plain_rope_mla_matches_transformers(plain_rope_deepseek):
    batch = mixed_batch(512, [37, 130, 5, 64], seed=21)
    with VllmHiddenStatesGenerator(
        str(plain_rope_deepseek),
        layer_ids=LAYERS,
        max_model_len=256,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=128,
    ) as generator:
        results = generator.generate(batch)
    assert_matches_reference(results, batch, HFReference(plain_rope_deepseek), LAYERS)
