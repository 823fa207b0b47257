"""Reading rows and building turns: tool rows set apart, reasoning kept or dropped, seeds fixed."""

from __future__ import annotations

import json

from speculators_vllm016.data_generation.regeneration.turns import (
    answer_of,
    has_tool_calls,
    load_source_rows,
    shard_rows,
    turn_seed,
)


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_are_read_like_datagen_reads_them(tmp_path):
    data = _write(
        tmp_path / "chat.jsonl",
        [
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"messages": [{"role": "user", "content": "only a question"}]},
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "trailing question"},
                ]
            },
        ],
    )
    rows = load_source_rows(data, max_samples=None, num_proc=1)
    assert rows[0].messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    assert rows[1].messages is None and rows[1].problem == "no assistant turn"
    assert [m["role"] for m in rows[2].messages] == ["user", "assistant"]  # trailing turn dropped
    assert [row.row for row in load_source_rows(data, max_samples=2, num_proc=1)] == [0, 1]


def test_tool_call_rows_are_set_apart():
    assert has_tool_calls([{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}])
    assert has_tool_calls([{"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}])
    # Arrow fills absent keys with None in every turn of a file: that is no tool call.
    assert not has_tool_calls([{"role": "assistant", "content": "x", "tool_calls": None}])


def test_reasoning_kept_or_dropped():
    text = "<think>count the legs</think>\n\nFour."
    assert answer_of(text, "keep") == text
    assert answer_of(text, "drop") == "Four."
    assert answer_of("Four.", "drop") == "Four."
    assert answer_of("<think>still thinking", "drop") is None


def test_turn_seeds_depend_on_seed_row_and_turn_only():
    seeds = {turn_seed(s, r, t) for s in range(2) for r in range(3) for t in range(3)}
    assert len(seeds) == 18
    assert turn_seed(7, 5, 1) == turn_seed(7, 5, 1)


def test_shards_take_every_nth_row():
    rows = list(range(7))
    assert shard_rows(rows, 3, 1) == [1, 4]
