"""Responses from vLLM 0.16's `LLM` in this process (the default engine of `regenerate`).

The prompts go in as token ids (`TokensPrompt`), rendered by `turns.prompt_token_ids`. Unset
sampling fields take the model's generation config (`ModelConfig.get_diff_sampling_param`, what
`vllm serve` fills unset request fields from), so this engine and a server agree. Responses come
back as token ids (the run decodes them); the end-of-turn token that stopped one is not part of it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from speculators_vllm016.data_generation.cpu_defaults import cpu_defaults_applied, is_cpu_platform
from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES
from speculators_vllm016.data_generation.regeneration.engines import (
    TurnRequest,
    TurnResponse,
    response_token_ids,
)
from speculators_vllm016.data_generation.regeneration.options import (
    RegenerateOptions,
    SamplingOptions,
    refuse_beyond_model_context,
)

__all__ = ["LocalEngine", "sampling_params"]

logger = logging.getLogger(__name__)


def sampling_params(sampling: SamplingOptions, seed: int, defaults: dict[str, Any]) -> Any:
    """vLLM `SamplingParams` of one turn: the options, unset ones from `defaults` as the server
    fills them (`CompletionRequest.to_sampling_params`)."""
    from vllm import SamplingParams

    def chosen(name: str, value: Any, neutral: Any) -> Any:
        return value if value is not None else defaults.get(name, neutral)

    return SamplingParams.from_optional(
        temperature=chosen("temperature", sampling.temperature, 1.0),
        top_p=chosen("top_p", sampling.top_p, 1.0),
        top_k=chosen("top_k", sampling.top_k, 0),
        min_p=defaults.get("min_p", 0.0),
        repetition_penalty=defaults.get("repetition_penalty", 1.0),
        max_tokens=sampling.max_tokens,
        seed=seed,
        detokenize=False,  # the run decodes the tokens (see `TurnResponse`)
    )


class LocalEngine:
    """A vLLM `LLM` on the target, started once and used for every round."""

    def __init__(self, options: RegenerateOptions) -> None:
        from vllm import LLM

        config_dict = options.target_config  # where the command read it (not read again)
        if config_dict is None:
            from transformers import PretrainedConfig

            config_dict, _ = PretrainedConfig.get_config_dict(
                options.target_model_path, trust_remote_code=options.trust_remote_code
            )
        refuse_beyond_model_context(options.resolved_max_model_len, config_dict)
        world_size = options.tensor_parallel_size * options.pipeline_parallel_size
        defaults = (
            cpu_defaults_applied(world_size, config_dict) if is_cpu_platform() else nullcontext({})
        )
        with defaults as chosen:
            for name, value in chosen.items():
                logger.info("vLLM CPU build: %s=%s (set it yourself to override)", name, value)
            self.llm = LLM(
                model=options.target_model_path,
                tokenizer=options.target_model_path,
                dtype=options.dtype,
                tensor_parallel_size=options.tensor_parallel_size,
                pipeline_parallel_size=options.pipeline_parallel_size,
                max_model_len=options.resolved_max_model_len,
                gpu_memory_utilization=options.gpu_memory_utilization,
                max_num_seqs=options.max_num_seqs,
                trust_remote_code=options.trust_remote_code,
                limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),
                disable_log_stats=True,
            )
        self.defaults = self.llm.model_config.get_diff_sampling_param()

    def respond(
        self, requests: Sequence[TurnRequest], sampling: SamplingOptions
    ) -> list[TurnResponse]:
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [sampling_params(sampling, r.seed, self.defaults) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        answers = []
        for output in outputs:
            completion = output.outputs[0]
            ids = response_token_ids(list(completion.token_ids), completion.finish_reason)
            answers.append(TurnResponse(ids, finish_reason=completion.finish_reason))
        return answers

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - the engine may already be down
                pass
            del llm
            gc.collect()
