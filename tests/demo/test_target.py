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


def test_short_rows_are_the_token_stream_cut_into_consecutive_whole_rows():
    """No token twice, none skipped but the last partial row (a row is never padded)."""
    from speculators_vllm016.demo.target import stream_rows

    conversations = [list(range(0, 5)), list(range(5, 12)), list(range(12, 23))]
    assert stream_rows(conversations, 4) == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert stream_rows(conversations, 23) == [list(range(23))]
    assert stream_rows(conversations, 24) == []


def test_each_pass_over_the_short_rows_trains_every_row_once_and_long_rows_are_shuffled():
    """A pass is a permutation of the rows (no row twice before every row once); the long rows
    come in a seeded shuffle too, not in the sessions' order."""
    import torch

    from speculators_vllm016.demo.target import TargetTraining, _step_batches

    rows = torch.arange(10).reshape(10, 1)
    options = TargetTraining(steps=10, row_tokens=1, rows_per_step=2)
    batches = list(_step_batches(rows, [], options, torch.Generator().manual_seed(0)))
    for first in (0, 5):  # two passes of five steps
        seen = sorted(int(v) for batch in batches[first : first + 5] for v in batch.flatten())
        assert seen == list(range(10))
    long_rows = [torch.full((1, 3), i) for i in range(8)]
    options = TargetTraining(steps=16, row_tokens=1, rows_per_step=2, long_every=2)
    batches = list(_step_batches(rows, long_rows, options, torch.Generator().manual_seed(0)))
    order = [int(batch[0, 0]) for batch in batches[1::2]]
    assert sorted(order) == list(range(8)) and order != list(range(8))


def test_long_rows_are_chained_from_the_first_conversations_only(tokenizer):
    """`max_conversations` (the demo's split) bounds the long rows as it bounds the short ones."""
    from speculators_vllm016.demo import demo_conversations_path, read_conversations
    from speculators_vllm016.demo.target import session_rows

    first = list(read_conversations(demo_conversations_path()))[:30]
    questions = {m["content"] for chat in first for m in chat if m["role"] == "user"}
    rows = session_rows(tokenizer, demo_conversations_path(), 400, limit=30)
    assert rows
    for row in rows:
        text = tokenizer.decode(row)
        asked = [
            part.split("<|eot_id|>")[0] for part in text.split("user<|end_header_id|>\n\n")[1:]
        ]
        assert asked and set(asked) <= questions


def _small_training(**change):
    from speculators_vllm016.demo.target import TargetTraining

    base = dict(steps=2, row_tokens=32, rows_per_step=2, long_row_tokens=400, long_every=2)
    return TargetTraining(**{**base, "max_conversations": 30, "show_progress": False, **change})


def test_the_target_trains_on_the_first_conversations_and_is_written_whole(
    tiny_llama, tmp_path, monkeypatch
):
    """Both kinds of rows come from the `max_conversations` first conversations; the result is
    written whole and a second call reuses it."""
    from speculators_vllm016.demo import demo_conversations_path, target

    limits = []
    for name in ("render_conversations", "session_rows"):
        real = getattr(target, name)

        def spy(*args, _real=real, **kwargs):
            limits.append(args[-1] if len(args) == 4 else args[2])
            return _real(*args, **kwargs)

        monkeypatch.setattr(target, name, spy)
    output = tmp_path / "target"
    result = target.train_demo_target(
        tiny_llama, output, demo_conversations_path(), _small_training()
    )
    assert limits == [30, 30]
    assert result.steps == 2 and not result.reused
    assert (output / target.RESULT_FILE).is_file() and (output / "config.json").is_file()
    assert target.train_demo_target(
        tiny_llama, output, demo_conversations_path(), _small_training()
    ).reused


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"row_tokens": 100_000}, "fill 0 rows of 100000 tokens"),
        ({"long_row_tokens": 20}, "no session of 20 tokens"),
    ],
)
def test_too_little_data_for_the_rows_is_one_line_before_anything_is_written(
    tiny_llama, tmp_path, change, words
):
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.target import train_demo_target
    from speculators_vllm016.utils.errors import InvalidInputError

    output = tmp_path / "target"
    with pytest.raises(InvalidInputError, match=words):
        train_demo_target(tiny_llama, output, demo_conversations_path(), _small_training(**change))
    assert not list(tmp_path.iterdir())
