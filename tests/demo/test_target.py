"""The demo reads chat rows exactly as datagen does (it had its own, narrower reader)."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.demo import read_conversations
from speculators_vllm016.demo.target import render_conversations
from speculators_vllm016.tiny_models import build_tokenizer

SHAREGPT = [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "It is 4."}]
# The same conversation as OpenAI-style messages, and with role names datagen also accepts.
MESSAGES = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
]
OTHER_ROLES = [
    {"from": "Human", "value": "What is 2 + 2?"},
    {"from": "chatgpt", "value": "It is 4."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), "llama3", vocab_size=300)


def test_rows_of_every_shape_datagen_reads_render_alike(tokenizer, tmp_path):
    rows = [{"conversations": SHAREGPT}, {"messages": MESSAGES}, {"conversations": OTHER_ROLES}]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    rendered = render_conversations(tokenizer, path)
    assert len(rendered) == 3 and rendered[0] == rendered[1] == rendered[2]


def test_rows_datagen_skips_are_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "chats.jsonl"
    rows = [
        json.dumps({"conversations": SHAREGPT}),
        "{not json",
        json.dumps({"conversations": SHAREGPT[:1]}),
    ]
    path.write_text("\n".join(rows) + "\n")
    assert len(list(read_conversations(path))) == 1
    assert "skipped 2 malformed conversations" in caplog.text


def _shipped_ids(tokenizer, limit: int) -> list[list[int]]:
    from speculators_vllm016.demo import demo_conversations_path

    return render_conversations(tokenizer, demo_conversations_path(), limit)


def test_every_short_row_starts_where_a_conversation_starts(tokenizer):
    """Served prompts start with a conversation's first token at position 0; rows cut anywhere
    from one token stream put that start anywhere but there (the demo's target then answered
    short prompts with nothing once its rows were long, #46)."""
    from speculators_vllm016.demo.target import TargetTraining, short_rows

    conversations = _shipped_ids(tokenizer, 40)
    rows = short_rows(conversations, TargetTraining(row_tokens=48))  # the demo's default kind
    stream = [token for ids in conversations for token in ids]
    assert len(rows) == len(conversations) and all(len(row) == 48 for row in rows)
    offset = 0
    for ids, row in zip(conversations, rows, strict=True):
        shared = min(len(ids), 48)
        assert row[:shared] == ids[:shared]  # the conversation from its first token
        assert row == stream[offset : offset + 48]  # continued into the next ones
        offset += len(ids)
    # A row longer than what is left after the last conversations' starts: those start none.
    longest = len(stream) - len(conversations[0]) + 1
    assert len(short_rows(conversations, TargetTraining(row_tokens=longest))) == 1


def test_long_rows_are_whole_chats_of_chained_turns_that_reach_their_length(tokenizer):
    """The long rows are the long prompts' shape (one chat, turns of several conversations) and
    as long as asked, within the bound."""
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.target import session_rows

    length = 1024
    rows = session_rows(tokenizer, demo_conversations_path(), length, limit=120)
    bos = tokenizer.bos_token_id
    assert len(rows) >= 3
    for row in rows:
        assert row[0] == bos and row.count(bos) == 1  # one chat, started at position 0
        assert 0.6 * length <= len(row) <= length
    assert sum(map(len, rows)) / len(rows) >= 0.85 * length


def test_every_nth_step_trains_on_one_long_row(tokenizer):
    import torch

    from speculators_vllm016.demo.target import TargetTraining, _step_batches

    rows = torch.arange(10 * 4).reshape(10, 4)
    long_rows = [torch.full((1, 16), i) for i in range(3)]
    options = TargetTraining(steps=12, row_tokens=4, rows_per_step=2, long_every=3)
    batches = list(_step_batches(rows, long_rows, options, torch.Generator().manual_seed(0)))
    assert [tuple(b.shape) for b in batches] == [(2, 4), (2, 4), (1, 16)] * 4
    assert sorted(int(b[0, 0]) for b in batches[2::3][:3]) == [0, 1, 2]  # each long row once
    again = list(_step_batches(rows, long_rows, options, torch.Generator().manual_seed(0)))
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    without = list(_step_batches(rows, [], options, torch.Generator().manual_seed(0)))
    assert [tuple(b.shape) for b in without] == [(2, 4)] * 12
