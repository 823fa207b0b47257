"""Helpers of the served-speculation tests: one speculative vLLM engine, and the greedy check.

The reference for "lossless" is transformers on the same weights, teacher-forced: every token the
speculative engine emitted must be the verifier's argmax after the tokens before it (a token
whose logit is within `TIE` of the maximum counts, so that fp32 rounding between two kernels
cannot turn a tie into a failure). A draft token accepted wrongly, a bonus token taken from the
wrong row or a KV cache left with rejected tokens all produce tokens that are not the argmax.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from speculators_vllm016.evaluate.vllm_engine import counts_from_metrics

TIE = 1e-3  # logits are O(1..10) on the tiny models; fp32 kernels differ by ~1e-5


@dataclass
class Served:
    """What a speculative engine produced: the same prompts generated twice, and its counters."""

    prompts: list[list[int]]
    first: list[list[int]]
    second: list[list[int]]  # the same prompts again: served from the prefix cache
    drafts: int
    accepted: int
    prefix_cache_hits: int


def prompts_of_lengths(lengths: Sequence[int], vocab: int = 512, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def serve(
    target: Path,
    speculative_config: dict,
    prompts: list[list[int]],
    max_tokens: int,
    tensor_parallel_size: int = 1,
) -> Served:
    """Start vLLM with `speculative_config` (CPU defaults applied as datagen does), generate the
    prompts twice in one batch each, and read vLLM's counters; the engine is shut down after."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculators_vllm016.data_generation.cpu_defaults import cpu_defaults_applied
    from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES

    config = json.loads((target / "config.json").read_text())
    with cpu_defaults_applied(tensor_parallel_size, config):
        llm = LLM(
            model=str(target),
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
            dtype="float32",
            enforce_eager=True,
            enable_prefix_caching=True,
            max_model_len=512,
            max_num_seqs=8,
            limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),  # Kimi: text only
            disable_log_stats=False,
            seed=0,
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        runs = [
            [list(r.outputs[0].token_ids) for r in llm.generate(requests, params, use_tqdm=False)]
            for _ in range(2)
        ]
        metrics = llm.get_metrics()
    finally:
        del llm
        gc.collect()
    k = int(speculative_config["num_speculative_tokens"])
    counts = counts_from_metrics(metrics, k)
    hits = sum(int(m.value) for m in metrics if m.name == "vllm:prefix_cache_hits")
    return Served(prompts, runs[0], runs[1], counts.num_drafts, counts.num_accepted_tokens, hits)


@torch.no_grad()
def not_greedy(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[str]:
    """Positions of `output` that are not the model's greedy choice after what precedes them."""
    ids = torch.tensor([prompt + output])
    logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    best = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(output)), torch.tensor(output)]
    return [
        f"token {i}: {output[i]} (logit {chosen[i]:.5f}) vs argmax {int(logits[i].argmax())} "
        f"({best[i]:.5f})"
        for i in range(len(output))
        if best[i] - chosen[i] > TIE
    ]


def load_reference(target: Path) -> torch.nn.Module:
    """The verifier in transformers, fp32 (for the Kimi-K2.5 wrapper, pass the folder of the
    language model it was built around: the same weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
