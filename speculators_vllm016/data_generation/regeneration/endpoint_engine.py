"""Responses from a running OpenAI-compatible server (`--endpoint URL`), e.g. `vllm serve`.

Each turn is one `/v1/completions` request whose prompt is the token ids that the in-process
engine gets (rendered here with the model's own chat template), so the server samples from the
same tokens; `/v1/chat/completions` would render the template on the server, with its own
defaults. The reply's token ids (vLLM's `return_token_ids`) are decoded here, as the in-process
engine's are, so both give the same text. Sampling fields left unset are left out of the request: the server fills them from the
model's generation config, as the in-process engine does. Requests run `concurrency` at a time;
a connection error, a timeout, 429 or a 5xx is retried with exponential backoff, and a turn still
failing is answered with the error (retryable: a later run tries it again).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from speculators_vllm016.data_generation.regeneration.engines import (
    TurnRequest,
    TurnResponse,
    response_token_ids,
)
from speculators_vllm016.data_generation.regeneration.options import (
    RegenerateOptions,
    SamplingOptions,
)
from speculators_vllm016.utils.errors import InvalidInputError, RunFailedError

__all__ = ["EndpointEngine", "completion_body"]

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
FIRST_BACKOFF_SECONDS = 1.0  # then doubled per retry, up to MAX_BACKOFF_SECONDS, jittered
MAX_BACKOFF_SECONDS = 30.0


def completion_body(model: str, request: TurnRequest, sampling: SamplingOptions) -> dict[str, Any]:
    """The JSON body of one turn's `/v1/completions` request."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": sampling.max_tokens,
        "seed": request.seed,
        "n": 1,
        "stream": False,
        "return_token_ids": True,  # vLLM's field: the run decodes the tokens itself
    }
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(sampling, name)
        if value is not None:
            body[name] = value
    return body


class EndpointEngine:
    """Turns sent to an OpenAI-compatible server; the served model is asked once at the start."""

    def __init__(self, options: RegenerateOptions) -> None:
        import httpx

        assert options.endpoint is not None
        self.base_url = options.endpoint.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.concurrency = options.concurrency
        self.timeout = options.request_timeout
        self.retries = options.retries
        try:
            reply = httpx.get(f"{self.base_url}/v1/models", timeout=self.timeout)
            reply.raise_for_status()
            served = [entry["id"] for entry in reply.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as error:
            raise RunFailedError(
                f"--endpoint {options.endpoint} does not answer /v1/models ({error}); is the "
                "server running?"
            ) from None
        if options.endpoint_model is not None:
            if options.endpoint_model not in served:
                raise InvalidInputError(
                    f"--endpoint-model {options.endpoint_model!r} is not served by "
                    f"{options.endpoint} (it serves {served})"
                )
            self.model = options.endpoint_model
        elif len(served) == 1:
            self.model = served[0]
        else:
            raise InvalidInputError(
                f"{options.endpoint} serves {len(served)} models {served}; pick one with "
                "--endpoint-model"
            )

    def respond(
        self, requests: Sequence[TurnRequest], sampling: SamplingOptions
    ) -> list[TurnResponse]:
        if not requests:
            return []
        return asyncio.run(self._respond_all(requests, sampling))

    async def _respond_all(
        self, requests: Sequence[TurnRequest], sampling: SamplingOptions
    ) -> list[TurnResponse]:
        import httpx

        gate = asyncio.Semaphore(self.concurrency)
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:

            async def one(request: TurnRequest) -> TurnResponse:
                async with gate:
                    return await self._respond(
                        client, completion_body(self.model, request, sampling)
                    )

            return list(await asyncio.gather(*(one(request) for request in requests)))

    async def _respond(self, client: Any, body: dict[str, Any]) -> TurnResponse:
        import httpx

        url = f"{self.base_url}/v1/completions"
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2.0 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random()))  # noqa: S311 - jitter only
            try:
                reply = await client.post(url, json=body)
            except httpx.HTTPError as error:
                problem = f"{type(error).__name__}: {error}"
                continue
            if reply.status_code in RETRY_STATUSES:
                problem = f"HTTP {reply.status_code}: {reply.text[:200]}"
                continue
            if reply.status_code != 200:
                return TurnResponse(
                    None,
                    error=f"server refused the request: HTTP "
                    f"{reply.status_code}: {reply.text[:200]}",
                )
            try:
                choice = reply.json()["choices"][0]
                finish = choice.get("finish_reason")
                if choice.get("token_ids") is None:  # not vLLM: its text, as it sent it
                    return TurnResponse(None, finish_reason=finish, text=str(choice["text"]))
                ids = response_token_ids([int(t) for t in choice["token_ids"]], finish)
                return TurnResponse(ids, finish_reason=finish)
            except (ValueError, KeyError, IndexError, TypeError):
                problem = f"unreadable reply: {reply.text[:200]}"
        attempts = self.retries + 1
        return TurnResponse(
            None, error=f"server error after {attempts} attempts ({problem})", retryable=True
        )

    def close(self) -> None:
        """Nothing held between rounds (each round opens its own connections)."""
