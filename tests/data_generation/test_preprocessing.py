"""Chat rendering, loss masks, malformed rows and token frequencies (no engine)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from datasets import Dataset

from speculators_vllm016.data_generation.conversations import normalize_conversation
from speculators_vllm016.data_generation.preprocessing import (
    build_eagle3_dataset,
    drop_turns,
    load_and_preprocess,
    load_and_preprocess_dataset,
    load_raw_dataset,
    preprocess_conversations,
)
from speculators_vllm016.tiny_models import build_tokenizer
from speculators_vllm016.train.vocab_mapping import save_token_frequency_distribution

SHAREGPT = [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "What is 2 + 2?"},
    {"from": "gpt", "value": "It is 4, of course."},
    {"from": "human", "value": "And 3 + 3?"},
    {"from": "gpt", "value": "Six. Next question?"},
]
# What each template appends for an assistant turn: its content and its end-of-turn marker.
ASSISTANT_SEGMENTS = {
    "llama3": ["It is 4, of course.<|eot_id|>", "Six. Next question?<|eot_id|>"],
    "chatml": ["It is 4, of course.<|im_end|>", "Six. Next question?<|im_end|>"],
}


@pytest.fixture(scope="module", params=["llama3", "chatml"])
def tokenizer(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tok_{request.param}")
    corpus = [turn["value"] for turn in SHAREGPT] * 3
    tok = build_tokenizer(path, request.param, corpus=corpus, vocab_size=400)
    tok.style = request.param
    return tok


def runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for index, value in enumerate([*mask, 0]):
        if value and start is None:
            start = index
        elif not value and start is not None:
            runs.append((start, index))
            start = None
    return runs


def test_loss_mask_is_exactly_the_assistant_tokens(tokenizer):
    dataset = build_eagle3_dataset(
        Dataset.from_list([{"conversations": SHAREGPT}]), tokenizer, num_proc=1
    )
    ids = dataset[0]["input_ids"].tolist()
    mask = dataset[0]["loss_mask"].tolist()
    assert len(ids) == len(mask)
    expected = ASSISTANT_SEGMENTS[tokenizer.style]
    runs = runs_of_ones(mask)
    assert [tokenizer.decode(ids[a:b]) for a, b in runs] == expected
    # Token by token: the masked tokens are exactly those that encode the assistant segments.
    for (a, b), segment in zip(runs, expected):
        assert ids[a:b] == tokenizer(segment, add_special_tokens=False)["input_ids"]
    # And the unmasked rest is everything else the template rendered, user turns included.
    rest = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "What is 2 + 2?" in rest and "And 3 + 3?" in rest and "You are terse." in rest
    assert "Six" not in rest and "of course" not in rest


def test_assistant_pattern_overrides_the_template(tokenizer):
    pattern = (
        r"<\|end_header_id\|>\n\n((?:(?!<\|eot_id\|>).)*?)<\|eot_id\|>"
        if tokenizer.style == "llama3"
        else r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>"
    )
    messages = Dataset.from_list([{"conversations": SHAREGPT}])
    dataset = build_eagle3_dataset(messages, tokenizer, num_proc=1, assistant_pattern=pattern)
    ids, mask = dataset[0]["input_ids"].tolist(), dataset[0]["loss_mask"].tolist()
    decoded = [tokenizer.decode(ids[a:b]) for a, b in runs_of_ones(mask)]
    if tokenizer.style == "chatml":
        assert decoded == ["It is 4, of course.", "Six. Next question?"]
    else:  # this pattern matches every turn's body: system and user turns too
        assert "It is 4, of course." in decoded and "What is 2 + 2?" in decoded


def test_truncation_to_seq_length(tokenizer):
    full = build_eagle3_dataset(
        Dataset.from_list([{"conversations": SHAREGPT}]), tokenizer, num_proc=1
    )
    cut = full[0]["loss_mask"].tolist().index(1) + 3  # keeps a few assistant tokens
    short = build_eagle3_dataset(
        Dataset.from_list([{"conversations": SHAREGPT}]), tokenizer, max_length=cut, num_proc=1
    )
    assert len(short[0]["input_ids"]) == cut
    assert short[0]["input_ids"].tolist() == full[0]["input_ids"][:cut].tolist()
    assert short[0]["loss_mask"].tolist() == full[0]["loss_mask"][:cut].tolist()


BAD_ROWS = {
    1: [{"from": "human", "value": "hi"}, {"value": "no role here"}],
    2: [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "   "}],
    3: [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ["not", "text"]}],
    5: [{"from": "human", "value": "only a question"}],
    6: [{"from": "narrator", "value": "hi"}, {"from": "gpt", "value": "ok"}],
    7: [],
}


def test_malformed_rows_are_skipped_counted_and_named(tokenizer, tmp_path, caplog):
    rows = []
    for index in range(9):
        turns = BAD_ROWS.get(index, SHAREGPT)
        rows.append({"id": index, "conversations": turns})
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    # Rows of mixed shapes do not fit one Arrow table: the loader falls back to reading row by row.
    raw = load_raw_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert len(raw) == 9
    with caplog.at_level(logging.WARNING):
        result = preprocess_conversations(raw, tokenizer, num_proc=1)
    dataset = result.dataset
    assert sorted(dataset["source_row"]) == [0, 4, 8]
    assert result.skipped_rows == 6
    message = " ".join(record.getMessage() for record in caplog.records)
    assert "skipped 6 of 9 conversations" in message
    for row in BAD_ROWS:
        assert f"row {row}:" in message
    assert "has no role" in message and "is empty" in message and "not text" in message
    assert "no assistant turn" in message and "unknown role 'narrator'" in message


def test_rows_emptied_by_truncation_are_counted_in_the_result(tiny_llama, tmp_path):
    long_question = [{"from": "human", "value": "a long question " * 200}, SHAREGPT[2]]
    rows = [SHAREGPT, long_question, SHAREGPT, [SHAREGPT[1]]]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": turns}) for turns in rows))
    result = load_and_preprocess(
        str(tiny_llama),
        str(data),
        seq_length=128,
        build_dataset_num_proc=1,
        token_freq_path=None,
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(result.dataset) == 2 and result.skipped_rows == 2
    assert result.tokenizer is not None and result.tokenizer.chat_template is not None
    # 0.3.0's entry point gives the same samples as (dataset, tokenizer).
    dataset, tokenizer = load_and_preprocess_dataset(
        str(tiny_llama),
        str(data),
        seq_length=128,
        build_dataset_num_proc=1,
        token_freq_path=None,
        cache_dir=str(tmp_path / "cache"),
    )
    assert dataset["source_row"] == result.dataset["source_row"]
    assert tokenizer.name_or_path == result.tokenizer.name_or_path


def test_nothing_usable_is_an_error(tokenizer):
    raw = Dataset.from_list([{"conversations": [{"from": "human", "value": "hi"}]}] * 3)
    with pytest.raises(ValueError, match="none of the 3 conversations is usable"):
        build_eagle3_dataset(raw, tokenizer, num_proc=1)


def test_local_files_in_both_shapes(tmp_path):
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text(json.dumps({"conversations": SHAREGPT}) + "\n")
    messages = tmp_path / "messages.json"
    as_messages = [
        {
            "role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
            "content": t["value"],
        }
        for t in SHAREGPT
    ]
    messages.write_text(json.dumps([{"messages": as_messages}]))
    first = load_raw_dataset(str(sharegpt), cache_dir=str(tmp_path / "cache"))
    second = load_raw_dataset(str(messages), cache_dir=str(tmp_path / "cache"))
    assert normalize_conversation(first[0]["conversations"]) == normalize_conversation(
        second[0]["messages"]
    )
    with pytest.raises(ValueError, match="unknown dataset"):
        load_raw_dataset("no-such-dataset")
    with pytest.raises(FileNotFoundError):
        load_raw_dataset(str(tmp_path / "missing.jsonl"))


def test_turn_dropout_keeps_a_prefix_ending_on_an_assistant_turn():
    import random

    messages = normalize_conversation(SHAREGPT)
    kept = {len(drop_turns(messages, random.Random(seed))) for seed in range(50)}
    assert kept == {3, 5}


def test_load_and_preprocess_and_token_frequencies(tiny_llama, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": SHAREGPT}) for _ in range(4)))
    freq_path = tmp_path / "token_freq.pt"
    dataset, tok = load_and_preprocess_dataset(
        str(tiny_llama),
        str(data),
        seq_length=512,
        build_dataset_num_proc=1,
        token_freq_path=str(freq_path),
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(dataset) == 4
    frequencies = torch.load(freq_path, weights_only=True)
    trained = torch.cat([row["input_ids"][row["loss_mask"].bool()] for row in dataset])
    unique, counts = trained.unique(return_counts=True)
    assert frequencies == dict(zip(unique.tolist(), counts.tolist()))
    assert sum(frequencies.values()) == int(sum(row["loss_mask"].sum() for row in dataset))
    # A stale file is replaced, not reused (0.3.0 kept whatever was there): the same call again.
    torch.save({0: 1}, freq_path)
    load_and_preprocess_dataset(
        str(tiny_llama),
        str(data),
        seq_length=512,
        build_dataset_num_proc=1,
        token_freq_path=str(freq_path),
        cache_dir=str(tmp_path / "cache"),
    )
    assert torch.load(freq_path, weights_only=True) == frequencies
    # The saver on its own also replaces a stale file.
    torch.save({0: 1}, freq_path)
    save_token_frequency_distribution(dataset, str(freq_path))
    assert torch.load(freq_path, weights_only=True) == frequencies


def test_a_file_mixing_both_row_shapes_keeps_every_row(tokenizer, tmp_path):
    """Loaded as one table, such a file has both columns; each row's own turns are used (the
    table once gave `messages` rows None turns, while the row-by-row reader kept them)."""
    as_messages = [
        {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
        for t in SHAREGPT[1:]
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"conversations": SHAREGPT})
        + "\n"
        + json.dumps({"messages": as_messages})
        + "\n"
    )
    raw = load_raw_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert {"conversations", "messages"} <= set(raw.column_names)
    result = preprocess_conversations(raw, tokenizer, num_proc=1)
    assert len(result.dataset) == 2 and result.skipped_rows == 0


def test_chat_template_kwargs_reach_every_rendering(tmp_path):
    """`--chat-template-kwargs` go to the template: the sample is the conversation rendered with
    them, and the loss mask still covers only what each assistant turn adds after its prompt.
    Without them the rendering is the template's default (0.3.0's)."""
    from tests.tiny_models import THINKING_TEMPLATE

    tokenizer = build_tokenizer(tmp_path, "llama3", corpus=[t["value"] for t in SHAREGPT] * 3)
    tokenizer.chat_template = THINKING_TEMPLATE
    messages = normalize_conversation(SHAREGPT)
    rows = Dataset.from_list([{"conversations": SHAREGPT}])
    for kwargs, expected_segments in (
        ({"thinking": False}, ASSISTANT_SEGMENTS["llama3"]),
        (None, ASSISTANT_SEGMENTS["llama3"]),
    ):
        result = preprocess_conversations(rows, tokenizer, num_proc=1, chat_template_kwargs=kwargs)
        ids, mask = result.dataset[0]["input_ids"].tolist(), result.dataset[0]["loss_mask"].tolist()
        text = tokenizer.apply_chat_template(messages, tokenize=False, **(kwargs or {}))
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ("<think></think>" in text) == (kwargs is not None)
        assert [tokenizer.decode(ids[a:b]) for a, b in runs_of_ones(mask)] == expected_segments


def test_a_row_that_is_json_but_no_list_of_turns_is_named_for_what_it_is(
    tokenizer, tmp_path, caplog, capfd
):
    """#50 item 11: `{"conversations": "oops"}` was reported as "not valid JSON", and datasets'
    own ERROR line (with pyarrow's message) came before the one warning."""
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"conversations": SHAREGPT}), json.dumps({"conversations": "oops"})]
    path.write_text("\n".join([*lines, "{not json", lines[0]]) + "\n")
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        raw = load_raw_dataset(str(path), cache_dir=str(tmp_path / "cache"))
        result = preprocess_conversations(raw, tokenizer, num_proc=1)
    assert "ERROR" not in capfd.readouterr().err
    assert [r.levelno for r in caplog.records if r.name.startswith("datasets")] == []
    assert result.skipped_rows == 2
    message = " ".join(record.getMessage() for record in caplog.records)
    assert "row 1: the conversation is a str, not a list of turns" in message, message
    assert "row 2: conversation is not valid JSON" in message, message


def test_the_done_line_counts_skipped_rows():
    from speculators_vllm016.data_generation.offline import DatagenSummary

    summary = DatagenSummary("out", 2, 2, 0, 10, 1.0, 1.0, skipped_rows=2)
    assert "of 2 (2 unusable chat rows skipped) in this shard" in summary.describe()
