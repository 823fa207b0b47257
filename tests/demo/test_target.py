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


def test_the_default_demo_target_trains_on_rows_as_long_as_the_long_prompts(tmp_path, monkeypatch):
    """Taught on short rows only, the demo's target answered differently at ~1,750-token prompts
    and both drafts' acceptance fell there from ~3.1-3.7 to 1.84 and 2.12 (#46): the default run's
    target stage must pass long rows at least as long as the prompts it serves."""
    from speculators_vllm016.demo import stages, target
    from speculators_vllm016.demo.options import DemoOptions

    seen = []

    def fake_training(initial, output, data, options):
        seen.append(options)
        return type("R", (), dict(tokens=1, tokens_per_second=1.0, first_loss=1.0, last_loss=1.0))()

    monkeypatch.setattr(target, "train_demo_target", fake_training)
    monkeypatch.setattr("speculators_vllm016.demo.build_demo_model", lambda path, data: path)
    options = DemoOptions(output_dir=str(tmp_path))
    run = stages.DemoRun(options=options, root=tmp_path, conversations=tmp_path / "x.jsonl")
    stages.STAGES["target"][0](run)
    (training,) = seen
    assert training.long_row_tokens >= options.long_context > 0
    assert 1 <= training.long_every <= training.steps


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
