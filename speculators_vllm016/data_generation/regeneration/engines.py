"""What an engine is asked and answers: one prompt (token ids) per turn, one response each.

Both engines, vLLM in this process (`local_engine`) and an OpenAI-compatible server
(`endpoint_engine`), take the same `TurnRequest`s and sampling options and resolve unset sampling
fields the same way (the model's generation config, as `vllm serve` does), so a row regenerates
to the same text on either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from speculators_vllm016.data_generation.regeneration.options import SamplingOptions

__all__ = ["ResponseEngine", "TurnRequest", "TurnResponse", "response_token_ids"]


@dataclass(frozen=True)
class TurnRequest:
    """The prompt of one assistant turn: the conversation so far, rendered and tokenized."""

    prompt_token_ids: list[int]
    seed: int  # `turns.turn_seed(seed, row, turn)`


@dataclass(frozen=True)
class TurnResponse:
    """The engine's answer to one turn: the tokens it generated, or why there are none.

    Tokens, not the engine's text: vLLM's incremental detokenizer holds back a trailing partial
    UTF-8 character at the end of a response, so its text can lose bytes that the tokens have;
    `response_token_ids` and the tokenizer decode what was generated in full. A server other
    than vLLM returns no token ids; its text is taken as it is.
    """

    token_ids: list[int] | None
    finish_reason: str | None = None  # "stop" (end of turn) or "length" (hit --max-tokens)
    text: str | None = None  # a server that returns no token ids (not vLLM): its text
    error: str | None = None
    retryable: bool = False  # a server failure a later run may try again


class ResponseEngine(Protocol):
    """Generates one response per request, in request order."""

    def respond(
        self, requests: Sequence[TurnRequest], sampling: SamplingOptions
    ) -> list[TurnResponse]: ...

    def close(self) -> None: ...


def response_token_ids(token_ids: list[int], finish_reason: str | None) -> list[int]:
    """The tokens of the turn itself: without the end-of-turn token that stopped it.

    vLLM lists the stop token among a response's tokens when it ends with finish reason "stop"
    (and drops it from the text); no stop strings are used here, so "stop" always means a
    stop token was sampled last.
    """
    return list(token_ids[:-1]) if finish_reason == "stop" and token_ids else list(token_ids)
