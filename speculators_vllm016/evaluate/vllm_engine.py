"""The `vllm` engine of `speculators eval`: vLLM 0.16 serving the draft, its own counters read back.

vLLM runs the verifier with `speculative_config={"method": "eagle3", "model": <draft folder>,
"num_speculative_tokens": k}` and keeps Prometheus counters of its drafts
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`, and the vector
`..._num_accepted_tokens_per_pos`), which `LLM.get_metrics()` returns when stats are on. They are
read before and after generation and the difference is this run's.

On vLLM 0.16's CPU build it runs through this package's plugin (`vllm_plugin/cpu_speculation.py`),
with `enforce_eager=True` and the CPU defaults datagen uses (`VLLM_MLA_DISABLE=1` for MLA targets,
a thread binding for tensor parallel); `speculative_decoding_unavailable()` says before an engine
starts when it cannot (plugin or CPU speculation switched off, another vLLM). There, on the tiny
models in fp32, its counts equal the hf engine's (tests/cli/test_eval_vllm.py). On a GPU the same
call runs vLLM as shipped; that has not been run here (no GPU with vLLM).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES
from speculators_vllm016.evaluate.acceptance import AcceptanceCounts
from speculators_vllm016.evaluate.generation import GenerationResult
from speculators_vllm016.utils.errors import RunFailedError, library_refusals_as_ours

__all__ = [
    "counts_difference",
    "counts_from_metrics",
    "VllmSettings",
    "evaluate_prompt_sets_with_vllm",
    "evaluate_with_vllm",
    "generate_sets_with_vllm",
    "generate_with_vllm",
    "on_cpu_build",
    "speculative_decoding_unavailable",
]

_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_decoding_unavailable() -> str | None:
    """Why this vLLM build cannot run speculative decoding, or None when it can.

    vLLM's CPU build speculates through this package's plugin (`vllm_plugin/cpu_speculation.py`)
    unless it is switched off or the vLLM is not 0.16.x.
    """
    try:
        from vllm.platforms import current_platform
    except Exception as error:  # noqa: BLE001 - any import failure means no vLLM engine
        return f"vLLM cannot be imported ({type(error).__name__}: {error})"
    if current_platform.is_cpu():
        from speculators_vllm016.vllm_plugin.cpu_speculation import cpu_speculation_unavailable

        return cpu_speculation_unavailable()
    return None


def on_cpu_build() -> bool:
    """vLLM runs on its CPU platform here (no accelerator vLLM can use)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - no vLLM: not its CPU build either
        return False
    return bool(current_platform.is_cpu())


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


@dataclass(frozen=True)
class VllmSettings:
    """How the verifier's engine is started (the same for the runs with and without a draft)."""

    dtype: str = "auto"
    ignore_eos: bool = False
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1
    seed: int = 0
    show_progress: bool = True
    trust_remote_code: bool = False


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
    verifier_config: dict | None = None,
) -> list[GenerationResult]:
    """Greedy generation of each prompt set in turn on one engine (one set's counters apart from
    the others': each is read before and after its own generation)."""
    reason = speculative_decoding_unavailable()
    if reason is not None:
        raise RunFailedError(f"{reason}; use --engine hf")
    settings = VllmSettings(
        dtype=dtype,
        ignore_eos=ignore_eos,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        show_progress=show_progress,
        trust_remote_code=trust_remote_code,
    )
    speculative_config = {
        "method": "eagle3",
        "model": draft_path,
        "num_speculative_tokens": num_speculative_tokens,
    }
    return generate_sets_with_vllm(
        verifier_path, prompt_sets, max_new_tokens, settings, speculative_config, verifier_config
    )


def generate_with_vllm(
    verifier_path: str,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    settings: VllmSettings,
    speculative_config: dict | None = None,
) -> GenerationResult:
    """Greedy generation of `prompts` by one vLLM engine, started for this call and shut down
    after; with `speculative_config`, the drafts' acceptance from vLLM's own counters (without,
    the counts are empty: the baseline a speculative run is compared with)."""
    return generate_sets_with_vllm(
        verifier_path, [prompts], max_new_tokens, settings, speculative_config
    )[0]


def generate_sets_with_vllm(
    verifier_path: str,
    prompt_sets: Sequence[Sequence[Sequence[int]]],
    max_new_tokens: int,
    settings: VllmSettings,
    speculative_config: dict | None = None,
    verifier_config: dict | None = None,
) -> list[GenerationResult]:
    """`generate_with_vllm` for each prompt set in turn on one engine: vLLM's counters are
    cumulative, so each set's are read before and after its own generation. `verifier_config`:
    the verifier's config.json where the caller read it (eval's set-up): not read again."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cpu = on_cpu_build()
    k = int(speculative_config["num_speculative_tokens"]) if speculative_config else 1
    with (
        library_refusals_as_ours(),
        _cpu_defaults(cpu, settings.tensor_parallel_size, verifier_path, verifier_config),
    ):
        llm = LLM(
            model=verifier_path,
            tokenizer=verifier_path,
            speculative_config=speculative_config,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            seed=settings.seed,
            trust_remote_code=settings.trust_remote_code,
            disable_log_stats=False,
            # Text only: a multimodal wrapper's (Kimi-K2.5's) encoders are never built.
            limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),
            enforce_eager=cpu,  # the CPU runner's speculation is checked without compilation
        )
    measured = []
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, ignore_eos=settings.ignore_eos
        )
        for prompts in prompt_sets:
            requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
            before = counts_from_metrics(llm.get_metrics(), k)
            start = time.perf_counter()
            results = llm.generate(requests, params, use_tqdm=settings.show_progress)
            seconds = time.perf_counter() - start
            after = counts_from_metrics(llm.get_metrics(), k)
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


@contextmanager
def _cpu_defaults(
    cpu: bool, tensor_parallel_size: int, verifier_path: str, config: dict | None = None
) -> Iterator[None]:
    """On the CPU build, the environment datagen's engines get (set for the engine's start).
    `config`: the verifier's config.json as the caller read it (None: read here)."""
    if not cpu:
        yield
        return
    from speculators_vllm016.data_generation.cpu_defaults import cpu_defaults_applied
    from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

    if config is None:
        config = load_verifier_config_dict(verifier_path)
    with cpu_defaults_applied(tensor_parallel_size, config):
        yield
