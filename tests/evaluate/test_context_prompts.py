"""Long evaluation prompts from the user's own chats: a held-out question after earlier turns of
the other conversations, as many whole turns as fit in the context length."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts
from speculators_vllm016.evaluate.context_prompts import context_prompt_sets, parse_context_lengths
from speculators_vllm016.evaluate.prompts import load_eval_prompts
from speculators_vllm016.evaluate.report import DraftEvaluation, tau_ratios
from speculators_vllm016.utils.errors import InvalidInputError

DEMO_DATA = Path(__file__).resolve().parents[2] / "speculators_vllm016/demo/conversations.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _pairs_of(row: int) -> list[str]:
    turns = json.loads(DEMO_DATA.read_text().splitlines()[row])["conversations"]
    return [turn["value"] for turn in turns]


def test_the_question_comes_last_after_whole_earlier_turns_of_the_next_conversations(tokenizer):
    data = str(DEMO_DATA)
    short = load_eval_prompts(data, tokenizer, max_prompts=4)
    sets = context_prompt_sets(data, tokenizer, [0, 300, 900], short.rows)
    assert [s.context_length for s in sets] == [0, 300, 900]
    assert sets[0].token_ids == short.token_ids  # length 0: the plain prompts
    assert sets == context_prompt_sets(data, tokenizer, [0, 300, 900], short.rows)  # reproducible
    for prompts in sets[1:]:
        for index, (ids, row) in enumerate(zip(prompts.token_ids, short.rows)):
            assert len(ids) <= prompts.context_length
            text = tokenizer.decode(ids)
            question = short.texts[index].split("<|start_header_id|>user<|end_header_id|>")[-1]
            assert text.endswith(question)  # the held-out question, then the answer's header
            assert _pairs_of(row)[0] not in text[: -len(question)]  # never its own turns before
    for ids, row in zip(sets[2].token_ids, short.rows):
        text = tokenizer.decode(ids)
        assert _pairs_of(row + 1)[0] in text and _pairs_of(row + 1)[1] in text  # whole turns
    # About L (the tiny tokenizer's demo pairs are 100-300 tokens; shorter ones fill the end).
    assert sets[2].mean_prompt_tokens > 0.9 * 900 and sets[1].mean_prompt_tokens > 0.6 * 300
    assert sets[1].mean_prompt_tokens < sets[2].mean_prompt_tokens


def test_data_too_small_for_a_length_gives_shorter_prompts_and_says_so(tokenizer, caplog, tmp_path):
    rows = DEMO_DATA.read_text().splitlines()[:3]
    data = tmp_path / "three.jsonl"
    data.write_text("\n".join(rows) + "\n")
    questions = load_eval_prompts(str(data), tokenizer, max_prompts=1).rows
    with caplog.at_level(logging.WARNING):
        [prompts] = context_prompt_sets(str(data), tokenizer, [100_000], questions)
    assert prompts.mean_prompt_tokens < 100_000
    assert "too few" in caplog.text
    text = tokenizer.decode(prompts.token_ids[0])
    assert all(turn in text for row in (1, 2) for turn in _pairs_of(row))  # all the others


def test_context_lengths_are_parsed_or_refused_naming_the_flag():
    assert parse_context_lengths("1750, 0,450,450") == [0, 450, 1750]
    for bad in ("", "a,b", "-1,4"):
        with pytest.raises(InvalidInputError, match="--context-lengths"):
            parse_context_lengths(bad)


def _row(draft: str, length: int | None, accepted: int) -> DraftEvaluation:
    counts = AcceptanceCounts(3, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=accepted)
    return DraftEvaluation(draft, draft, "hf", 3, counts, 0, 0.0, context_length=length)


def test_tau_is_compared_with_the_same_drafts_shortest_length():
    rows = [_row("a", 1000, 10), _row("a", 0, 20), _row("b", 0, 10), _row("b", 1000, 10)]
    assert tau_ratios(rows) == [pytest.approx(2.0 / 3.0), 1.0, 1.0, 1.0]
    assert tau_ratios([_row("a", None, 5)]) == [None]


def test_the_prompts_are_those_built_before_the_assembly_moved_to_data_generation(tokenizer):
    """`data_generation.sessions` now chooses the pairs (as it does for training sessions); the
    prompts are token for token those of the code before the move (its sha256 pinned here)."""
    import hashlib

    data = str(DEMO_DATA)
    short = load_eval_prompts(data, tokenizer, max_prompts=4)
    sets = context_prompt_sets(data, tokenizer, [0, 300, 900], short.rows)
    digest = hashlib.sha256(json.dumps([s.token_ids for s in sets]).encode()).hexdigest()
    assert digest == "a28cd2561577a92a2741c0b8ea63b725156fd5790c796a1674ceeb41635ed00e"
