"""The chat rows to regenerate, and the prompt of each assistant turn.

Rows are read with datagen's own loader (`preprocessing.load_raw_dataset`: local files and the
named presets) and brought to `[{"role", "content"}]` by `conversations.normalize_conversation`,
so every row datagen accepts is regenerated and every row it refuses is listed with the same
reason. Rows with tool calls are set apart (the responses around a tool call cannot be
regenerated without running the tool). Turns after the last assistant turn are dropped: nothing
trains on them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speculators_vllm016.data_generation.conversations import (
    MalformedRowError,
    normalize_conversation,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "SourceRow",
    "TOOL_ROLES",
    "answer_of",
    "assistant_positions",
    "has_tool_calls",
    "load_source_rows",
    "prompt_token_ids",
    "rows_digest",
    "shard_rows",
    "turn_seed",
]

TOOL_ROLES = frozenset({"tool", "function", "ipython", "observation"})
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class SourceRow:
    """One row of the chat data, as regeneration sees it."""

    row: int  # its index in the data (after --max-samples, before sharding)
    raw: Any  # its turns as stored: what a kept tool-call row is written as
    messages: list[dict[str, str]] | None  # normalized turns; None when `problem` is set
    problem: str | None = None  # why it is not regenerated
    has_tools: bool = False


def has_tool_calls(turns: Any) -> bool:
    """A turn in a tool role, or one carrying tool or function calls."""
    if not isinstance(turns, list):
        return False
    for turn in turns:
        if not isinstance(turn, Mapping):
            continue
        role = turn.get("role", turn.get("from"))
        if isinstance(role, str) and role.lower() in TOOL_ROLES:
            return True
        if turn.get("tool_calls") or turn.get("function_call"):
            return True
    return False


def _source_row(row: int, stored: Any) -> SourceRow:
    turns = stored
    if isinstance(stored, str):
        try:
            turns = json.loads(stored)
        except json.JSONDecodeError:
            turns = stored  # normalize_conversation names the problem
    if has_tool_calls(turns):
        return SourceRow(row, turns, None, "has tool calls", has_tools=True)
    try:
        messages = normalize_conversation(turns)
    except MalformedRowError as error:
        return SourceRow(row, turns, None, str(error))
    last = max(assistant_positions(messages))
    return SourceRow(row, turns, messages[: last + 1])


def load_source_rows(
    train_data_path: str,
    max_samples: int | None,
    num_proc: int = 8,
    cache_dir: str | None = None,
) -> list[SourceRow]:
    """The first `max_samples` rows of the data (all when None), in the data's order."""
    from speculators_vllm016.data_generation.preprocessing import (
        _ensure_conversations,
        load_raw_dataset,
    )

    dataset = _ensure_conversations(load_raw_dataset(train_data_path, num_proc, cache_dir))
    if len(dataset) == 0:
        raise InvalidInputError(
            f"{train_data_path} holds no conversations; check --train-data-path"
        )
    count = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    stored = dataset.select(range(count))["conversations"]
    return [_source_row(row, turns) for row, turns in enumerate(stored)]


def shard_rows(rows: list[SourceRow], num_shards: int, shard_index: int) -> list[SourceRow]:
    """Shard I takes rows I, I+N, I+2N, ... (datagen's rule)."""
    return rows[shard_index::num_shards]


def rows_digest(rows: list[SourceRow]) -> str:
    """sha256 of every row's stored turns, in order: another data file is another job."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row.raw, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def assistant_positions(messages: list[dict[str, str]]) -> list[int]:
    return [index for index, message in enumerate(messages) if message["role"] == "assistant"]


def turn_seed(seed: int, row: int, turn: int) -> int:
    """The sampling seed of one turn: fixed by (seed, row, turn), whatever batch it is in."""
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any]
) -> list[int]:
    """The conversation so far rendered with the generation prompt, as token ids.

    Rendered to text and tokenized without added special tokens, as datagen tokenizes the
    finished conversation and as vLLM's chat endpoint does, so the response continues exactly
    the tokens datagen will later feed the target.
    """
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_of(text: str, reasoning: str) -> str | None:
    """What goes into the assistant turn: the response (`keep`), or what follows its thinking
    block (`drop`); None when `drop` finds a thinking block that never closed."""
    if reasoning == "keep":
        return text
    if THINK_CLOSE in text:
        return text.split(THINK_CLOSE, 1)[1].lstrip()
    if text.lstrip().startswith(THINK_OPEN):
        return None
    return text
