"""vLLM 0.16's own speculative decoding on its CPU build (the plugin's `cpu_speculation`) is lossless.

One engine per case, started once: a batch of six prompts of different lengths generated greedily
with speculation, then the same batch again with prefix caching on (served from the cache). Every
emitted token must be the verifier's greedy choice in transformers on the same weights (see
served.py), both runs must agree, and the counters must show drafts made and accepted, so that
the acceptance path (accepted prefixes, bonus tokens, rejected tails dropped from the KV cache)
ran, not only rejection.

EAGLE-3 drafts are "logit lens" drafts (tests/evaluate/drafts.py): right often, not always.
DeepSeek-V3 and the Kimi-K2.5 wrapper are served through this package's plugin; their drafts carry
the positions `speculators train` writes for Kimi-K2.5, the published Kimi-K2.5 drafts' (theta
50000, YaRN factor 64 from 4096, 262,144 positions): vLLM loads and speculates with them as
written (#46). The Kimi case runs at tensor parallel 2 (its language model is the DeepSeek-V3 path of the TP1 case, so one
model at TP2 covers the sharded runner), checked against the same DeepSeek-V3 weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.evaluate.drafts import logit_lens_draft
from tests.vllm_plugin.served import load_reference, not_greedy, prompts_of_lengths, serve

pytestmark = pytest.mark.engine

# vLLM's CPU build caches whole blocks of 128 tokens, and for EAGLE drops the last block it
# matched (its hidden states are recomputed): the 300-token prompt's rerun hits the cache.
LENGTHS = [5, 37, 300, 80, 23, 3]
NEW_TOKENS = 16
K = 3

# (id, target fixture, method, the draft's aux ids (the logit lens reads the last), tensor
# parallel, reference). The Llama and Qwen3 have 4 layers, the DeepSeek-V3 3 (aux id 0: embeddings).
CASES = [
    ("llama-eagle3", "tiny_llama", "eagle3", (1, 2, 3), 1, "tiny_llama"),
    ("llama-ngram", "tiny_llama", "ngram", None, 1, "tiny_llama"),
    ("qwen3-eagle3", "tiny_qwen3", "eagle3", (1, 2, 3), 1, "tiny_qwen3"),
    ("deepseek_v3-eagle3", "tiny_deepseek_v3", "eagle3", (0, 1, 2), 1, "tiny_deepseek_v3"),
    ("kimi_k25-eagle3-tp2", "tiny_kimi_k25", "eagle3", (0, 1, 2), 2, "tiny_deepseek_v3"),
]


# What `speculators train` writes for a Kimi-K2.5 (DeepSeek-V3) target's Llama-layer draft
# (tests/vllm_compat/test_draft_positions.py checks the writing and vLLM's rotation of it).
KIMI_K25_DRAFT_POSITIONS = {
    "rope_theta": 50000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "max_position_embeddings": 262144,
}


def speculative_config(method: str, target: Path, aux_ids: tuple | None, folder: Path) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    import json

    architecture = json.loads((target / "config.json").read_text())["architectures"][0]
    draft = logit_lens_draft(str(target), architecture, aux_ids, K)
    if architecture in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        for key, value in KIMI_K25_DRAFT_POSITIONS.items():
            setattr(draft.config.transformer_layer_config, key, value)
    draft.save_pretrained(folder)
    return {"method": method, "model": str(folder), "num_speculative_tokens": K}


@pytest.mark.parametrize(
    ("target_name", "method", "aux_ids", "tp", "reference_name"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_speculative_greedy_output_is_the_verifiers_greedy_output(
    target_name, method, aux_ids, tp, reference_name, request, tmp_path, monkeypatch
):
    target: Path = request.getfixturevalue(target_name)
    if tp > 1:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the defaults pick one
    config = speculative_config(method, target, aux_ids, tmp_path / "draft")
    prompts = prompts_of_lengths(LENGTHS)
    served = serve(target, config, prompts, NEW_TOKENS, tensor_parallel_size=tp)

    assert [len(o) for o in served.first] == [NEW_TOKENS] * len(prompts)
    assert served.second == served.first, "the prefix-cached rerun changed the output"
    assert served.prefix_cache_hits > 0, "the rerun did not use the prefix cache"
    assert served.drafts > 0, "no draft was made"
    if target_name != "tiny_qwen3":  # its logit lens accepts nothing on these prompts (measured)
        assert served.accepted > 0, (served.drafts, served.accepted)
    assert served.accepted < served.drafts * K, "every draft token accepted: rejection never ran"

    reference = load_reference(request.getfixturevalue(reference_name))
    wrong = {
        index: bad
        for index, (prompt, output) in enumerate(zip(prompts, served.first))
        if (bad := not_greedy(reference, prompt, output))
    }
    assert not wrong, f"speculative output is not the verifier's greedy output: {wrong}"
