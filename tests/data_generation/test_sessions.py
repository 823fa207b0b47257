"""Sessions chained from whole user/assistant pairs (`--session-tokens`): the assembly itself on a
counting stand-in for a tokenizer, then as datagen's preprocessing builds them with the tiny
Llama's tokenizer (no engine here: tests/data_generation/test_offline.py extracts them)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculators_vllm016.data_generation.offline import shard_positions
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.preprocessing import load_and_preprocess
from speculators_vllm016.data_generation.resume import (
    check_identity,
    record_identity,
    run_identity,
    samples_digest,
)
from speculators_vllm016.data_generation.sessions import (
    MAX_MISSES,
    assemble_sessions,
    fill_with_pairs,
    fit_whole,
    turn_pairs,
)
from speculators_vllm016.demo import demo_conversations_path
from speculators_vllm016.demo.held_out import DRAFT_FILE, split_of_file, write_split
from speculators_vllm016.utils.errors import InvalidInputError
from tests.data_generation.test_preprocessing import runs_of_ones


def _words(messages) -> list[int]:
    """A stand-in tokenizer: one token a word, two a turn, one for the template's header."""
    return [0] * (1 + sum(len(m["content"].split()) + 2 for m in messages))


def _conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    rows = []
    for row in range(count):
        turns = []
        if row % 5 == 0:
            turns.append({"role": "system", "content": f"system prompt {row}"})
        for turn in range(rng.randint(1, 4)):
            turns.append({"role": "user", "content": f"q{row}.{turn} " * rng.randint(1, 12)})
            turns.append({"role": "assistant", "content": f"a{row}.{turn} " * rng.randint(1, 40)})
        rows.append(turns)
    return rows


def _pairs_in(session) -> list[tuple[str, str]]:
    return [(pair[0]["content"], pair[1]["content"]) for pair in turn_pairs(session)]


def test_sessions_chain_whole_pairs_each_at_most_once_within_the_bound_and_fill_it():
    rows = _conversations(300)
    sessions = assemble_sessions(rows, _words, 200)
    assert sessions == assemble_sessions(rows, _words, 200)  # deterministic
    source = [p for row in rows for p in _pairs_in(row)]
    used = []
    for session in sessions:
        assert len(_words(session)) <= 200
        assert [m["role"] for m in session] == ["user", "assistant"] * (len(session) // 2)
        assert len(session) >= 4  # two pairs at least: one alone is its conversation
        used += _pairs_in(session)  # whole pairs: each (question, answer) as in its row
    assert len(used) == len(set(used)) and set(used) <= set(source)
    assert len(used) > 0.9 * len(source)  # little is left over
    fill = [len(_words(session)) for session in sessions[:-1]]
    assert sum(fill) / len(fill) > 0.9 * 200  # about N tokens each
    assert assemble_sessions(rows[::-1], _words, 200) != sessions  # the order decides them


def test_a_pair_longer_than_a_session_is_left_out_and_counted(caplog):
    long_answer = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 500}]
    rows = [long_answer, *_conversations(40)]
    with caplog.at_level(logging.WARNING):
        sessions = assemble_sessions(rows, _words, 200)
    assert "1 user/assistant pairs are longer than a session's 200 tokens" in caplog.text
    assert all(("q", "a " * 500) not in _pairs_in(session) for session in sessions)
    assert sessions


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory) -> Path:
    lines = demo_conversations_path().read_text().splitlines()[:120]
    path = tmp_path_factory.mktemp("sessions") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _preprocess(tiny_llama, data, **flags):
    base = dict(
        seq_length=2048, build_dataset_num_proc=1, token_freq_path=None, max_samples=60, seed=3
    )
    return load_and_preprocess(str(tiny_llama), str(data), **{**base, **flags})


def _texts(result) -> list[str]:
    return [result.tokenizer.decode(ids) for ids in result.dataset["input_ids"]]


def test_sessions_follow_the_conversations_as_samples_with_the_loss_on_every_answer(
    tiny_llama, demo_rows
):
    plain = _preprocess(tiny_llama, demo_rows)
    both = _preprocess(tiny_llama, demo_rows, session_tokens=1200)
    only = _preprocess(tiny_llama, demo_rows, session_tokens=1200, sessions_only=True)
    rows = both.dataset["source_row"]
    count = len(plain.dataset)
    assert rows[:count] == plain.dataset["source_row"]  # the conversations first, as before
    assert rows[count:] == [-k for k in range(1, len(rows) - count + 1)]  # then the sessions
    assert only.dataset["source_row"] == rows[count:]
    assert len(only.dataset) >= 8
    for index, ids in enumerate(only.dataset["input_ids"]):
        assert torch_equal(ids, both.dataset[count + index]["input_ids"])
        assert 0.7 * 1200 < len(ids) <= 1200  # about N, never over, never cut (below)
    # Each session is the conversations' own pairs, whole, with the loss on every answer.
    chats = [json.loads(line)["conversations"] for line in demo_rows.read_text().splitlines()]
    answers = {turn["value"] for chat in chats for turn in chat if turn["from"] == "gpt"}
    for text, mask in zip(_texts(only), only.dataset["loss_mask"]):
        assert text.endswith("<|eot_id|>")  # the last answer is whole
        turns = text.count("<|start_header_id|>assistant<|end_header_id|>")
        assert len(runs_of_ones(mask.tolist())) == turns >= 2
        assert sum(answer in text for answer in answers) >= turns  # every answer is one of them
    assert _texts(only) == _texts(
        _preprocess(tiny_llama, demo_rows, session_tokens=1200, sessions_only=True)
    )
    other_seed = _preprocess(tiny_llama, demo_rows, session_tokens=1200, sessions_only=True, seed=4)
    assert _texts(other_seed) != _texts(only)  # the data seed orders the pairs


def torch_equal(a, b) -> bool:
    return a.tolist() == b.tolist()


def test_sessions_hold_only_the_selected_conversations_and_never_a_held_out_question(
    tiny_llama, tmp_path
):
    """The demo holds questions out of training: its drafts' file has none of them, and a
    session is built from that file's rows (the `--max-samples` first after the shuffle) only."""
    lines, split = split_of_file(demo_conversations_path(), 4, None)
    paths = write_split(lines, split, tmp_path)
    only = _preprocess(
        tiny_llama, paths[DRAFT_FILE], session_tokens=1500, sessions_only=True, max_samples=80
    )
    held = [question for question in split.questions]
    assert held
    texts = _texts(only)
    assert not [q for q in held for text in texts if q in text]
    plain = _texts(_preprocess(tiny_llama, paths[DRAFT_FILE], max_samples=80))
    selected = {question for text in plain for question in _questions_in(text)}
    assert {q for text in texts for q in _questions_in(text)} <= selected


def _questions_in(text: str) -> list[str]:
    parts = text.split("<|start_header_id|>user<|end_header_id|>\n\n")[1:]
    return [part.split("<|eot_id|>")[0] for part in parts]


def test_session_flags_are_checked_before_any_work():
    def options(**flags):
        return DatagenOptions(
            target_model_path="m", train_data_path="d.jsonl", output_dir="o", **flags
        )

    options(session_tokens=2048, seq_length=2048).validate()
    for flags, words in (
        (
            {"session_tokens": 4096, "seq_length": 2048},
            "--session-tokens 4096 is over --seq-length",
        ),
        ({"session_tokens": -1}, "--session-tokens must be 0"),
        ({"sessions_only": True}, "--sessions-only needs --session-tokens"),
    ):
        with pytest.raises(InvalidInputError, match=words):
            options(**flags).validate()


def test_shards_split_the_sessions_like_any_sample(tiny_llama, demo_rows):
    result = _preprocess(tiny_llama, demo_rows, session_tokens=1200)
    rows = result.dataset["source_row"]
    shards = [shard_positions(len(rows), 3, index) for index in range(3)]
    assert sorted(p for shard in shards for p in shard) == list(range(len(rows)))
    assert all(any(rows[p] < 0 for p in shard) for shard in shards)  # each shard has sessions


def test_a_changed_session_flag_is_named_when_a_folder_of_another_run_is_refused(
    tiny_llama, demo_rows, tmp_path
):
    facts = SimpleNamespace(path=str(tiny_llama), layer_ids=[2, 2, 1, 3])

    def identity(**flags):
        options = DatagenOptions(
            target_model_path=str(tiny_llama),
            train_data_path=str(demo_rows),
            output_dir=str(tmp_path),
            max_samples=60,
            seed=3,
            **flags,
        )
        digest = samples_digest(_preprocess(tiny_llama, demo_rows, **flags).dataset)
        return run_identity(options, facts, digest)

    record_identity(tmp_path, identity())
    assert not check_identity(tmp_path, identity(), adopt_existing=False)  # the same run resumes
    with pytest.raises(InvalidInputError, match="session_tokens: was 0, now 1200"):
        check_identity(tmp_path, identity(session_tokens=1200), adopt_existing=False)
    record_identity(tmp_path, identity(session_tokens=1200))
    with pytest.raises(InvalidInputError, match="sessions_only: was False, now True"):
        check_identity(
            tmp_path, identity(session_tokens=1200, sessions_only=True), adopt_existing=False
        )


LONG = 131_072


def test_a_128k_token_session_stays_whole_from_preprocessing_to_the_packed_training_row(
    tiny_llama, tmp_path, caplog
):
    """`--seq-length 131072 --session-tokens 131072`: nothing on the way cuts the session (the
    chat template, the tokenizer, the sample file, the trainer's lengths, sampler and packing)."""
    import torch

    from speculators_vllm016.data_generation.sample_io import write_sample
    from speculators_vllm016.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators_vllm016.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )

    answer = json.loads(demo_conversations_path().read_text().splitlines()[0])["conversations"]
    text = " ".join(turn["value"] for turn in answer)
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"part {i}?"},
                {"from": "gpt", "value": text},
            ]
        }
        for i in range(40 * 8)
    ]
    chats = tmp_path / "long.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = load_and_preprocess(
        str(tiny_llama),
        str(chats),
        LONG,
        build_dataset_num_proc=1,
        token_freq_path=None,
        session_tokens=LONG,
        sessions_only=True,
    )
    ids, mask = result.dataset[0]["input_ids"], result.dataset[0]["loss_mask"]
    assert 0.97 * LONG < len(ids) <= LONG
    decoded = result.tokenizer.decode(ids)
    turns = decoded.count("<|start_header_id|>assistant<|end_header_id|>")
    assert decoded.endswith("<|eot_id|>") and len(runs_of_ones(mask.tolist())) == turns

    hidden = 8
    states = [torch.randn(len(ids), hidden, dtype=torch.bfloat16) for _ in range(4)]
    path = tmp_path / "data_0.pt"
    write_sample(path, {"input_ids": ids, "loss_mask": mask, "hidden_states": states})
    data = Eagle3SampleFileDataset(LONG, file_list=[str(path)], widths=(3 * hidden, hidden))
    with caplog.at_level(logging.WARNING):
        sampler = MultipackDistributedBatchSamplerV2(LONG, data.lengths, 1, 0)
        [[index]] = list(iter(sampler))
    assert "longer than" not in caplog.text
    row = create_collate_fn(LONG)([data[index]])
    assert row["lengths"].tolist() == [len(ids) - 1]  # every position after the one-token shift
    assert int(row["loss_mask"].sum()) >= int(mask.sum()) - 1


def _template(header: int, between: int):
    """A stand-in template: `header` tokens a rendering, and `between` x pairs^2 more between
    the pairs (growing with them): with a big header a pair alone costs more than inside a
    session; with a big `between` a session costs more than its pairs alone."""

    def render(messages) -> list[int]:
        pairs = len(messages) // 2
        words = sum(len(m["content"].split()) + 2 for m in messages)
        return [0] * (header + words + between * pairs * pairs)

    return render


@pytest.mark.parametrize(("header", "between"), [(30, 1), (10, 2)])
def test_a_session_is_filled_again_and_a_pair_that_overflows_it_opens_the_next(header, between):
    """The first estimate counts each pair's header: the session is filled again with what it
    left free; a pair the whole rendering does not fit goes back to the pool, not lost."""
    render = _template(header, between)
    rows = _conversations(300)
    sessions = assemble_sessions(rows, render, 400)
    source = [p for row in rows for p in _pairs_in(row)]
    used = [p for session in sessions for p in _pairs_in(session)]
    assert len(used) == len(set(used)) and set(used) <= set(source)
    assert len(used) > 0.97 * len(source)
    fill = [len(render(session)) for session in sessions[:-1]]
    assert all(length <= 400 for length in fill) and sum(fill) / len(fill) > 0.9 * 400


def test_many_pairs_longer_than_a_session_do_not_stop_the_assembly():
    long_pairs = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a " * 500}]
        for i in range(2 * MAX_MISSES)
    ]
    rows = _conversations(40)
    assert assemble_sessions([*long_pairs, *rows], _words, 200) == assemble_sessions(
        rows, _words, 200
    )


def test_only_a_user_turn_answered_right_after_it_is_a_pair():
    user = [{"role": "user", "content": f"u{i}"} for i in range(3)]
    answer = [{"role": "assistant", "content": f"a{i}"} for i in range(2)]
    system = {"role": "system", "content": "s"}
    messages = [system, user[0], user[1], answer[0], answer[1], user[2]]
    assert list(turn_pairs(messages)) == [[user[1], answer[0]]]


def test_pairs_fill_the_budget_exactly_and_the_search_gives_up_after_max_misses_in_a_row():
    def pairs(costs):
        return [[{"role": "user", "content": str(i)}, {"cost": c}] for i, c in enumerate(costs)]

    def cost(pair):
        return pair[1]["cost"]

    def costs_of(chosen):
        return [cost(pair) for pair in chosen]

    assert costs_of(fill_with_pairs(pairs([20, 30]), cost, 50)) == [20, 30]  # exactly full
    # A pair that fits resets the count of misses.
    misses = [100] * (MAX_MISSES - 1)
    assert costs_of(fill_with_pairs(pairs([5, *misses, 5, *misses, 5]), cost, 50)) == [5, 5, 5]
    assert costs_of(fill_with_pairs(pairs([5, *misses, 100, 5]), cost, 50)) == [5]


def test_a_rendering_exactly_as_long_as_the_bound_is_kept_whole():
    chosen = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a a a"}]] * 2
    exact = len(_words([m for pair in chosen for m in pair]))
    assert len(fit_whole(list(chosen), _words, exact)) == exact
    kept = list(chosen)
    fit_whole(kept, _words, exact - 1)
    assert len(kept) == 1
