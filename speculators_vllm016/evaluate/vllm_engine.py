"""The `vllm` engine of `speculators eval`: vLLM 0.16 serving the draft, its own counters read back.

vLLM runs the verifier with `speculative_config={"method": "eagle3", "model": <draft folder>,
"num_speculative_tokens": k}` and keeps Prometheus counters of its drafts
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`, and the vector
`..._num_accepted_tokens_per_pos`), which `LLM.get_metrics()` returns when stats are on. They are
read before and after generation and the difference is this run's. vLLM's CPU build refuses
speculative decoding; `speculative_decoding_unavailable()` says so before an engine is started.

Status: this engine has never run end to end (the CPU build refuses speculative decoding and the
GPUs it was developed with had no vLLM). The counter names, `get_metrics`' conversion of the
per-position counter into one `Vector` per engine, and the differencing were checked against
vLLM 0.16's sources (`v1/spec_decode/metrics.py`, `v1/metrics/reader.py`) and are tested with
vLLM's own logger and reader; the engine call itself is unverified on a GPU.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts
from speculators_vllm016.evaluate.generation import GenerationResult
from speculators_vllm016.utils.errors import RunFailedError, library_refusals_as_ours

__all__ = [
    "counts_difference",
    "counts_from_metrics",
    "evaluate_prompt_sets_with_vllm",
    "evaluate_with_vllm",
    "speculative_decoding_unavailable",
]

_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_decoding_unavailable() -> str | None:
    """Why this vLLM build cannot run speculative decoding, or None when it can."""
    try:
        from vllm.platforms import current_platform
    except Exception as error:  # noqa: BLE001 - any import failure means no vLLM engine
        return f"vLLM cannot be imported ({type(error).__name__}: {error})"
    if current_platform.is_cpu():
        return "vLLM's CPU build refuses speculative decoding"
    return None


def counts_from_metrics(metrics: Sequence[object], num_speculative_tokens: int) -> AcceptanceCounts:
    """Sum vLLM's spec-decode counters over engines (`LLM.get_metrics()` entries)."""
    counts = AcceptanceCounts(num_speculative_tokens)
    for metric in metrics:
        name = getattr(metric, "name", None)
        if name == _DRAFTS:
            counts.num_drafts += int(metric.value)  # type: ignore[attr-defined]
        elif name == _DRAFT_TOKENS:
            counts.num_draft_tokens += int(metric.value)  # type: ignore[attr-defined]
        elif name == _ACCEPTED:
            counts.num_accepted_tokens += int(metric.value)  # type: ignore[attr-defined]
        elif name == _PER_POSITION:
            values = list(metric.values)  # type: ignore[attr-defined]
            for position, value in enumerate(values[:num_speculative_tokens]):
                counts.accepted_per_position[position] += int(value)
    return counts


def counts_difference(after: AcceptanceCounts, before: AcceptanceCounts) -> AcceptanceCounts:
    """What happened between two readings of vLLM's (cumulative) counters."""
    return AcceptanceCounts(
        num_speculative_tokens=after.num_speculative_tokens,
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_position=[
            a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position)
        ],
    )


def evaluate_with_vllm(
    draft_path: str,
    verifier_path: str,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_speculative_tokens: int,
    **options: Any,
) -> GenerationResult:
    """Greedy generation of `prompts` by vLLM with the draft; acceptance from vLLM's counters.
    `options` as in `evaluate_prompt_sets_with_vllm`."""
    return evaluate_prompt_sets_with_vllm(
        draft_path, verifier_path, [prompts], max_new_tokens, num_speculative_tokens, **options
    )[0]


def evaluate_prompt_sets_with_vllm(
    draft_path: str,
    verifier_path: str,
    prompt_sets: Sequence[Sequence[Sequence[int]]],
    max_new_tokens: int,
    num_speculative_tokens: int,
    *,
    dtype: str = "auto",
    ignore_eos: bool = False,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.8,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    show_progress: bool = True,
    trust_remote_code: bool = False,
) -> list[GenerationResult]:
    """Greedy generation of each prompt set in turn on one engine (one set's counters apart from
    the others': each is read before and after its own generation)."""
    reason = speculative_decoding_unavailable()
    if reason is not None:
        raise RunFailedError(f"{reason}; use --engine hf")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with library_refusals_as_ours():  # vLLM checks the settings as the engine starts
        llm = LLM(
            model=verifier_path,
            tokenizer=verifier_path,
            speculative_config={
                "method": "eagle3",
                "model": draft_path,
                "num_speculative_tokens": num_speculative_tokens,
            },
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            trust_remote_code=trust_remote_code,
            disable_log_stats=False,
        )
    measured = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos)
        for prompts in prompt_sets:
            requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
            before = counts_from_metrics(llm.get_metrics(), num_speculative_tokens)
            start = time.perf_counter()
            results = llm.generate(requests, params, use_tqdm=show_progress)
            seconds = time.perf_counter() - start
            after = counts_from_metrics(llm.get_metrics(), num_speculative_tokens)
            outputs = [list(result.outputs[0].token_ids) for result in results]
            measured.append(
                GenerationResult(
                    outputs=outputs, counts=counts_difference(after, before), seconds=seconds
                )
            )
    finally:
        del llm
        gc.collect()
    return measured
