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
