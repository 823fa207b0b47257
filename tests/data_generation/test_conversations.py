"""One reader of chat-row shapes for datagen, the evaluation prompts and the demo."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.data_generation.conversations import (
    MalformedRowError,
    conversation_of,
    normalize_conversation,
    skip_reason,
)

SHAREGPT = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_each_row_gives_its_own_turns():
    assert conversation_of({"conversations": SHAREGPT}) == SHAREGPT
    assert conversation_of({"messages": MESSAGES}) == MESSAGES
    # A file mixing both shapes, loaded as one table, holds None in the other column.
    assert conversation_of({"conversations": None, "messages": MESSAGES}) == MESSAGES
    assert conversation_of(SHAREGPT) == SHAREGPT
    assert normalize_conversation(SHAREGPT) == normalize_conversation(json.dumps(MESSAGES))


def test_roles_are_matched_as_datagen_does():
    turns = [{"from": "Human", "value": "hi"}, {"from": "chatgpt", "value": "hello"}]
    assert [m["role"] for m in normalize_conversation(turns)] == ["user", "assistant"]
    with pytest.raises(MalformedRowError, match="unknown role 'narrator'"):
        normalize_conversation([{"from": "narrator", "value": "x"}, *SHAREGPT])


def test_skip_reason_groups_equal_problems():
    assert skip_reason("turn 3 is empty") == skip_reason("turn 12 is empty") == "is empty"
    assert skip_reason("no assistant turn") == "no assistant turn"
