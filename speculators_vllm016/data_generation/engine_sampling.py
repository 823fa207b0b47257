"""Sampled responses from the hidden-states generator's own engine, so one engine load serves
both regeneration and extraction (`speculators datagen --regenerate`).

While `capture_paused` holds, the workers' capture hooks are removed (`speculators_teardown`:
the runner then runs vLLM's own `execute_model`), and `sample_responses` drives ordinary
generation requests through the generator's scheduler and step loop, as `EngineCore` would.
Requests are made by vLLM's own `InputProcessor` (the generation config's stop tokens and the
tokenizer's end-of-sequence token, as `LLM.generate` gets them), so a response equals what
`vllm.LLM` with the same sampling parameters returns. On leaving, capture is set up again exactly
as at start-up (`engine_setup.setup_capture`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from speculators_vllm016.data_generation.engine_setup import setup_capture
from speculators_vllm016.utils.errors import RunFailedError

__all__ = ["capture_paused", "sample_responses"]

_calls = itertools.count()


@contextmanager
def capture_paused(generator: Any) -> Iterator[None]:
    """Hooks off for the block (generation runs at full speed and writes nothing), back after.

    Not after a block that failed or was stopped: the generator is then given up, and its
    workers may be gone (a stop signal sent to the process group ends them too), so asking them
    would only hide the block's own error."""
    generator._executor.collective_rpc("speculators_teardown")
    yield
    setup_capture(
        generator._executor,
        generator.layer_ids,
        generator.num_hidden_layers,
        generator.hidden_size,
        generator.dtype,
        generator._transfer,
    )


def sample_responses(
    generator: Any, prompts: Sequence[list[int]], params: Sequence[Any]
) -> list[tuple[list[int], str]]:
    """(generated token ids, finish reason) of each prompt, in prompt order; call it inside
    `capture_paused`. The token ids are vLLM's: a stop token that ended a response is the last."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.request import Request

    processor = getattr(generator, "_input_processor", None)
    if processor is None:
        processor = generator._input_processor = InputProcessor(generator.vllm_config)
    call = next(_calls)
    requests: dict[str, Request] = {}
    for index, (ids, sampling) in enumerate(zip(prompts, params, strict=True)):
        request_id = f"g{call}-{index}"
        core_request = processor.process_inputs(
            request_id, TokensPrompt(prompt_token_ids=list(ids)), sampling
        )
        request = Request.from_engine_core_request(core_request, generator._block_hasher)
        requests[request_id] = request
        generator._scheduler.add_request(request)
    finished: dict[str, str] = {}
    idle_steps = 0
    while len(finished) < len(requests):
        step = generator._step_fn()
        idle_steps = 0 if step.num_scheduled_tokens or step.finished else idle_steps + 1
        if idle_steps > 2 and not step.num_tokens_in_flight:
            raise RunFailedError(
                f"the scheduler stopped making progress with {len(requests) - len(finished)} "
                "responses unfinished (KV cache too small for one sequence?)"
            )
        for output in step.finished:
            if output.request_id in requests:
                finished[output.request_id] = str(output.finish_reason)
    return [
        (list(requests[request_id].output_token_ids), finished[request_id])
        for request_id in requests
    ]
