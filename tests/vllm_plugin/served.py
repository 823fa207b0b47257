"""Helpers of the served-speculation tests: one speculative vLLM engine, the greedy check, and
the `hf` engine's speculative decoding with the counters vLLM's must equal.

The reference for "lossless" is transformers on the same weights, teacher-forced: every token the
speculative engine emitted must be the verifier's argmax after the tokens before it (a token
whose logit is within `TIE` of the maximum counts, so that fp32 rounding between two kernels
cannot turn a tie into a failure). A draft token accepted wrongly, a bonus token taken from the
wrong row or a KV cache left with rejected tokens all produce tokens that are not the argmax.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts
from speculators_vllm016.evaluate.vllm_engine import counts_from_metrics

TIE = 1e-3  # logits are O(1..10) on the tiny models; fp32 kernels differ by ~1e-5


@dataclass
class Served:
    """What a speculative engine produced: the prompts generated once or twice, and its counters."""

    prompts: list[list[int]]
    first: list[list[int]]
    second: list[list[int]] | None  # `passes=2`: the same prompts again, from the prefix cache
    counts: AcceptanceCounts  # vLLM's counters over every pass, per position too
    prefix_cache_hits: int

    @property
    def drafts(self) -> int:
        return self.counts.num_drafts

    @property
    def accepted(self) -> int:
        return self.counts.num_accepted_tokens


def prompts_of_lengths(lengths: Sequence[int], vocab: int = 512, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def serve(
    target: Path,
    speculative_config: dict,
    prompts: list[list[int]],
    max_tokens: int,
    tensor_parallel_size: int = 1,
    *,
    passes: int = 2,
    prefix_caching: bool | None = True,
    max_model_len: int = 512,
    max_num_seqs: int | None = 8,
    async_scheduling: bool | None = None,
) -> Served:
    """Start vLLM with `speculative_config` (CPU defaults applied as datagen does), generate the
    prompts `passes` times in one batch each, and read vLLM's counters; the engine is shut down
    after. `None` leaves an engine argument at vLLM's default (what a test compared before)."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculators_vllm016.data_generation.cpu_defaults import cpu_defaults_applied
    from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES

    optional = {
        "enable_prefix_caching": prefix_caching,
        "max_num_seqs": max_num_seqs,
        "async_scheduling": async_scheduling,
    }
    config = json.loads((target / "config.json").read_text())
    with cpu_defaults_applied(tensor_parallel_size, config):
        llm = LLM(
            model=str(target),
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),  # Kimi: text only
            disable_log_stats=False,
            seed=0,
            **{name: value for name, value in optional.items() if value is not None},
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        runs = [
            [list(r.outputs[0].token_ids) for r in llm.generate(requests, params, use_tqdm=False)]
            for _ in range(passes)
        ]
        metrics = llm.get_metrics()
    finally:
        del llm
        gc.collect()
    counts = counts_from_metrics(metrics, int(speculative_config["num_speculative_tokens"]))
    hits = sum(int(m.value) for m in metrics if m.name == "vllm:prefix_cache_hits")
    return Served(prompts, runs[0], runs[1] if passes > 1 else None, counts, hits)


class ServedOnce:
    """`serve` memoized on what decides the engine's output: the target, the draft folder's bytes,
    the prompts and the options. Two tests whose drafts are the same files (a converted export
    equal to another) then share one engine start; a module-scoped fixture holds it."""

    def __init__(self) -> None:
        self._done: dict[str, Served] = {}

    def __call__(
        self,
        target: Path,
        speculative_config: dict,
        prompts: list[list[int]],
        max_tokens: int,
        **options,
    ) -> Served:
        draft = Path(speculative_config["model"])
        digest = hashlib.sha256()
        for path in sorted(p for p in draft.rglob("*") if p.is_file()):
            digest.update(path.relative_to(draft).as_posix().encode() + path.read_bytes())
        key = json.dumps(
            [
                str(target),
                digest.hexdigest(),
                {**speculative_config, "model": None},
                prompts,
                max_tokens,
                options,
            ],
            sort_keys=True,
        )
        if key not in self._done:
            self._done[key] = serve(target, speculative_config, prompts, max_tokens, **options)
        return self._done[key]


@dataclass
class HfRun:
    """The `hf` engine's greedy speculative decoding (what `eval --engine hf` computes)."""

    outputs: list[list[int]]
    counts: AcceptanceCounts


def hf_speculative(
    target: Path,
    draft: Path,
    prompts: list[list[int]],
    max_tokens: int,
    k: int,
    *,
    verifier_weights: bool = False,
) -> HfRun:
    """The verifier in transformers (a wrapper's language model) with the draft, fp32, no EOS (as
    `serve`'s `ignore_eos`). `verifier_weights`: the draft loaded detached and given the
    verifier's embeddings and head, as eval loads a draft that does not store them."""
    from speculators_vllm016.evaluate.speculative import speculative_generate
    from speculators_vllm016.model import SpeculatorModel
    from speculators_vllm016.models.eagle3 import Eagle3DraftModel
    from speculators_vllm016.models.verifier_lm import load_verifier_lm

    verifier = load_verifier_lm(str(target), torch.float32).eval()
    if verifier_weights:
        model = SpeculatorModel.from_pretrained(str(draft), verifier_attachment_mode="detached")
        model.load_verifier_weights(str(target))
    else:
        model = Eagle3DraftModel.from_pretrained(draft)
    model = model.float().eval()
    result = speculative_generate(verifier, model, prompts, max_tokens, k, eos_token_ids=[])
    return HfRun(result.outputs, result.counts)


def assert_same_counts(served: AcceptanceCounts, hf: AcceptanceCounts) -> None:
    """vLLM's counters equal the `hf` engine's, and acceptance is neither nothing nor all."""
    assert served.num_drafts > 0 and 0 < served.num_accepted_tokens < served.num_draft_tokens
    assert (served.num_drafts, served.num_draft_tokens, served.num_accepted_tokens) == (
        hf.num_drafts,
        hf.num_draft_tokens,
        hf.num_accepted_tokens,
    )
    assert list(served.accepted_per_position) == list(hf.accepted_per_position)


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
