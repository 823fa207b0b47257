"""Crash-safe JSON-lines logs: a torn line is skipped, and the next record starts a line of its own."""

from __future__ import annotations

from speculators_vllm016.utils.json_lines import JsonLinesAppender, read_json_lines


def test_a_torn_line_is_skipped_and_the_next_record_starts_a_new_line(tmp_path):
    path = tmp_path / "log.jsonl"
    with JsonLinesAppender(path) as log:
        log.append({"row": 0})
    with open(path, "a") as handle:
        handle.write('{"row": 1, "mess')  # a kill in the middle of an append
    assert list(read_json_lines(path)) == [{"row": 0}]
    with JsonLinesAppender(path) as log:
        log.append({"row": 2, "text": "é"})
    assert list(read_json_lines(path)) == [{"row": 0}, {"row": 2, "text": "é"}]
    assert list(read_json_lines(tmp_path / "missing.jsonl")) == []
