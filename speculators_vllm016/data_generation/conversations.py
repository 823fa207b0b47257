"""Chat data shapes -> one shape: the turns of a row as `[{"role", "content"}]`.

Rows hold their turns under `conversations` (ShareGPT: `{"from": "human"|"gpt", "value": ...}`)
or `messages` (UltraChat/OpenAI: `{"role": ..., "content": ...}`). Datagen, the evaluation
prompts and the demo all read chat data through these two functions, so a row one of them accepts
the others accept too. No heavy imports: the demo's corpus reader uses this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["MalformedRowError", "conversation_of", "normalize_conversation", "skip_reason"]

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


class MalformedRowError(InvalidInputError):
    """A conversation that cannot be turned into a training sample."""


def conversation_of(row: Any) -> Any:
    """The turns of one raw row: its `conversations`, else its `messages`; a list is the turns.

    Per row, so a file mixing both shapes reads every row. The turns are returned as stored
    (not yet checked): see `normalize_conversation`.
    """
    if isinstance(row, Mapping):
        turns = row.get("conversations")
        return turns if turns is not None else row.get("messages")
    return row


def normalize_conversation(turns: Any) -> list[dict[str, str]]:
    """Bring one conversation to `[{"role", "content"}]`; raise `MalformedRowError` if unusable.

    `turns` is a list of turn mappings, or that list JSON-encoded (how rows of mixed shapes are
    kept). Roles are matched case-insensitively against ShareGPT's and OpenAI's names.
    """
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as exc:
            raise MalformedRowError(f"conversation is not valid JSON ({exc.msg})") from None
    if not isinstance(turns, list):
        kind = "no conversation" if turns is None else f"a {type(turns).__name__}"
        raise MalformedRowError(f"the conversation is {kind}, not a list of turns")
    if not turns:
        raise MalformedRowError("no turns")
    messages = []
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRowError(f"turn {position} is a {type(turn).__name__}, not a mapping")
        raw_role = turn.get("role", turn.get("from"))
        if raw_role is None:
            raise MalformedRowError(f"turn {position} has no role")
        role = ROLES.get(str(raw_role).lower())
        if role is None:
            raise MalformedRowError(f"turn {position} has unknown role {raw_role!r}")
        content = turn.get("content", turn.get("value"))
        if not isinstance(content, str):
            raise MalformedRowError(
                f"turn {position} content is {type(content).__name__}, not text"
            )
        if not content.strip():
            raise MalformedRowError(f"turn {position} is empty")
        messages.append({"role": role, "content": content})
    if not any(message["role"] == "assistant" for message in messages):
        raise MalformedRowError("no assistant turn")
    return messages


def skip_reason(error: str) -> str:
    """A row's error without its turn number, so equal problems are counted together."""
    return re.sub(r"^turn \d+ ", "", error)
