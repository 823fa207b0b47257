"""vLLM 0.16 (CPU build, this package's plugin) loads and speculates with a draft whose config has
YaRN positions and a sliding window as `speculators train` writes them, and its proposals are the
`hf` eval engine's (the trainer's model with the same window and positions)."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.evaluate.vllm_engine import counts_difference, counts_from_metrics
from tests.evaluate.drafts import build_draft

PROMPTS = [[0, *range(5, 45)], [0, 17, 250, 3, 99] * 6]  # 41 and 30 tokens: past the window of 8
NEW_TOKENS = 24


@pytest.mark.engine
def test_vllm_speculates_with_a_yarn_sliding_window_draft_as_written(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculators_vllm016.evaluate.runner import _load_draft
    from speculators_vllm016.evaluate.speculative import speculative_generate

    draft = build_draft(str(tiny_llama), sliding_window=8)
    draft.config.transformer_layer_config.rope_scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    folder = tmp_path / "draft"
    draft.save_pretrained(folder)
    llm = LLM(
        model=str(tiny_llama),
        speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3},
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        disable_log_stats=False,
        seed=0,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        before = counts_from_metrics(llm.get_metrics(), 3)
        served = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
        counts = counts_difference(counts_from_metrics(llm.get_metrics(), 3), before)
    finally:
        del llm
    verifier = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    loaded = _load_draft(str(folder), torch.float32, "cpu")
    assert loaded.attention_window == 8
    simulated = speculative_generate(verifier, loaded, PROMPTS, NEW_TOKENS, 3)
    assert [list(r.outputs[0].token_ids) for r in served] == simulated.outputs  # greedy kept
    assert counts.num_drafts > 0
    assert counts.accepted_per_position == simulated.counts.accepted_per_position
