"""The generator on more architectures of docs/datagen.md's list, each against transformers.

One tiny checkpoint and one engine per architecture (vLLM 0.16's CPU build, float32); each test
runs a batch with sequences longer than any sliding window and compares every layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
    VllmHiddenStatesGenerator,
)
from speculators_vllm016.tiny_models import build_tokenizer
from tests.hf_reference import HFReference, assert_matches_reference, mixed_batch

pytestmark = pytest.mark.engine

VOCAB = 512
WINDOW = 48  # sliding window of the models that have one; the batch has longer sequences
COMMON = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=4,
    pad_token_id=1,
    torch_dtype="float32",
)


def qwen2_config():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(num_hidden_layers=4, **COMMON)


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        num_hidden_layers=3,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        **COMMON,
    )
    return Qwen3MoeForCausalLM, config


def mistral_config():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(
        num_hidden_layers=4, head_dim=64, sliding_window=WINDOW, **COMMON
    )


def deepseek_v2_config():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    settings = {**COMMON, "num_key_value_heads": 4}
    config = DeepseekV2Config(
        num_hidden_layers=3,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        # As for the tiny DeepSeek-V3 (tests/tiny_models.py): plain RoPE written as yarn with
        # factor 1, as real configs write it (rope_scaling=None: test_deepseek_plain_rope.py).
        rope_scaling={
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        **settings,
    )
    return DeepseekV2ForCausalLM, config


def gemma2_config():
    """Sliding-window and full-attention layers alternate: two KV cache groups in vLLM."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    settings = {**COMMON, "tie_word_embeddings": True}  # vLLM's Gemma2 requires tied embeddings
    config = Gemma2Config(
        num_hidden_layers=4,
        head_dim=64,
        sliding_window=WINDOW,
        query_pre_attn_scalar=64,
        hidden_act="gelu_pytorch_tanh",  # vLLM reads hidden_act, transformers hidden_activation
        # transformers' SDPA attention ignores logit soft-capping (its eager path applies it), so
        # the reference would differ from the model by ~3e-4: leave soft-capping out.
        attn_logit_softcapping=None,
        **settings,
    )
    return Gemma2ForCausalLM, config


ARCHITECTURES = {
    "qwen2": qwen2_config,
    "qwen3_moe": qwen3_moe_config,
    "mistral": mistral_config,
    "deepseek_v2": deepseek_v2_config,
    "gemma2": gemma2_config,
}
KV_CACHE_GROUPS = {"gemma2": 2}  # the others: 1


def build(name: str, path: Path) -> Path:
    model_class, config = ARCHITECTURES[name]()
    config.initializer_range = 0.05
    torch.manual_seed(3)
    model = model_class(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer(path, "llama3", vocab_size=VOCAB)
    return path


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_matches_transformers(name, models_dir):
    path = build(name, models_dir / f"arch_{name}")
    reference = HFReference(path)
    layers = list(range(int(reference.model.config.num_hidden_layers)))
    batch = mixed_batch(VOCAB, [1, 200, 31, 90, 5, 140, 300, 64], seed=11)
    with VllmHiddenStatesGenerator(
        str(path),
        layer_ids=layers,
        max_model_len=512,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=128,
    ) as generator:
        assert len(generator._scheduler.kv_cache_config.kv_cache_groups) == KV_CACHE_GROUPS.get(
            name, 1
        )
        results = generator.generate(batch)
    assert_matches_reference(results, batch, reference, layers)
