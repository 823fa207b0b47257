"""The draft's positions as vLLM 0.16 serves them: for every target family's RoPE, the draft config
that `speculators train` writes makes vLLM's `Eagle3LlamaForCausalLM` (built from the checkpoint as
written) rotate queries and keys exactly as the trainer's layer does, past the original window too.
No engine: vLLM's own config parser and draft model class on the CPU (tests/vllm_compat/harness.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.models.eagle3.model_definitions import _rotary
from speculators_vllm016.train.jobs.draft_build import build_draft_config
from tests.vllm_compat.harness import load_eagle3_into_vllm, shutdown_vllm_distributed

KIMI_K25_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# (text model type, theta, scaling, max positions, positions checked): one per family of RoPE.
FAMILIES = {
    "kimi_k25": ("deepseek_v3", 50000.0, KIMI_K25_YARN, 262144, [0, 1, 4095, 4096, 9000, 20000]),
    "llama3": (
        "llama",
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        8192,
        [0, 5, 1023, 1024, 3000, 8000],
    ),
    "qwen3_yarn": (
        "qwen3",
        1000000.0,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        8192,
        [0, 7, 2047, 2048, 5000, 8000],
    ),
    "linear": ("llama", 10000.0, {"type": "linear", "factor": 4.0}, 4096, [0, 3, 1000, 4000]),
    "dynamic": ("llama", 10000.0, {"type": "dynamic", "factor": 2.0}, 1024, [0, 3, 1000, 2000]),
    "plain": ("qwen3", 1000000.0, None, 4096, [0, 3, 1000, 4000]),
}


class _TextConfig:
    """A target's text config as the trainer reads it (attributes)."""

    def __init__(self, model_type: str, theta: float, scaling: dict | None, max_positions: int):
        self.model_type = model_type
        self.vocab_size = 512
        self.hidden_size = 64
        self.intermediate_size = 128
        self.num_attention_heads = 2
        self.num_key_value_heads = 2
        self.head_dim = 32
        self.rms_norm_eps = 1e-6
        self.rope_theta = theta
        self.rope_scaling = dict(scaling) if scaling else None
        self.max_position_embeddings = max_positions
        self.architectures = ["StandIn"]


@pytest.fixture(scope="module", autouse=True)
def _vllm_distributed_teardown():
    yield
    shutdown_vllm_distributed()


def _draft_folder(family: str, tiny_llama: Path, folder: Path) -> Path:
    model_type, theta, scaling, max_positions, _ = FAMILIES[family]
    text = _TextConfig(model_type, theta, scaling, max_positions)
    config = build_draft_config(
        str(tiny_llama),
        text,
        text,
        draft_vocab=128,
        num_layers=1,
        norm_before_residual=True,
        ttt_steps=3,
        aux_layer_ids=[1, 2, 3],
    )
    torch.manual_seed(0)
    Eagle3DraftModel(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_rotates_the_drafts_queries_and_keys_as_training_does(family, tiny_llama, tmp_path):
    folder = _draft_folder(family, tiny_llama, tmp_path / family)
    positions = FAMILIES[family][4]
    served = load_eagle3_into_vllm(folder, tiny_llama).model.model.layers[0].self_attn
    trained = Eagle3DraftModel.from_pretrained(folder)
    heads, head_dim = 2, 32
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(len(positions), heads * head_dim, generator=generator)
    key = torch.randn(len(positions), heads * head_dim, generator=generator)
    at = torch.tensor(positions)

    vllm_query, vllm_key = served.rotary_emb.forward_native(at, query.clone(), key.clone())
    cos, sin = trained.rotary_emb(query[None], at[None])
    ours_query, ours_key = _rotary(
        query.view(1, -1, heads, head_dim), key.view(1, -1, heads, head_dim), cos, sin
    )
    # float32 angles of up to ~20k radians: a last-bit difference in a frequency moves them ~1e-3.
    torch.testing.assert_close(
        vllm_query.view(1, -1, heads, head_dim), ours_query, atol=5e-3, rtol=0
    )
    torch.testing.assert_close(vllm_key.view(1, -1, heads, head_dim), ours_key, atol=5e-3, rtol=0)


def test_a_kimi_k25_draft_writes_the_published_drafts_positions(tiny_llama, tmp_path):
    """What the published Kimi-K2.5 drafts write: theta 50000, YaRN factor 64 from 4096 (betas 32
    and 1), 262,144 positions; vLLM's parsed config keeps them as written."""
    from tests.vllm_compat.harness import parse_with_vllm

    folder = _draft_folder("kimi_k25", tiny_llama, tmp_path / "kimi")
    layer = Eagle3DraftModel.from_pretrained(folder).config.transformer_layer_config
    assert layer.rope_theta == 50000.0 and layer.max_position_embeddings == 262144
    assert layer.rope_scaling == {
        "rope_type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    parsed = parse_with_vllm(folder)["hf_config"]
    assert parsed["rope_theta"] == 50000.0 and parsed["max_position_embeddings"] == 262144
    assert parsed["rope_scaling"]["rope_type"] == "yarn" and parsed["rope_scaling"]["factor"] == 64


def test_vllm_builds_a_sliding_window_draft_with_its_window(tiny_llama, tmp_path):
    """`speculators train --sliding-window 64` writes `layer_types` / `sliding_window` as vLLM 0.16
    reads them: its draft layer (indexed past the target's layers) gets the window."""
    model_type, theta, scaling, max_positions, _ = FAMILIES["llama3"]
    text = _TextConfig(model_type, theta, scaling, max_positions)
    config = build_draft_config(
        str(tiny_llama),
        text,
        text,
        draft_vocab=128,
        num_layers=1,
        norm_before_residual=True,
        ttt_steps=3,
        aux_layer_ids=[1, 2, 3],
        sliding_window=64,
    )
    folder = tmp_path / "sliding"
    Eagle3DraftModel(config).save_pretrained(folder)
    assert Eagle3DraftModel.from_pretrained(folder).attention_window == 64
    served = load_eagle3_into_vllm(folder, tiny_llama).model.model.layers[0].self_attn
    assert served.attn.sliding_window == 64
    with pytest.raises(ValueError, match="--sliding-window 2 is shorter than --ttt-steps 3"):
        build_draft_config(
            str(tiny_llama),
            text,
            text,
            draft_vocab=128,
            num_layers=1,
            norm_before_residual=True,
            ttt_steps=3,
            aux_layer_ids=[1, 2, 3],
            sliding_window=2,
        )
