"""Evaluation prompts: the conversation up to its first assistant turn, with the generation prompt."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from speculators_vllm016.evaluate.prompts import load_eval_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_prompt_is_the_turns_before_the_first_answer(tmp_path, tokenizer):
    system_user = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rows = [
        {"conversations": [{"from": "gpt", "value": "I speak first."}]},
        {
            "conversations": system_user
            + [
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": "No."},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "Numbers?"},
                {"from": "gpt", "value": "1 2 3"},
            ]
        },
        {"conversations": [{"from": "human", "value": "Third?"}, {"from": "gpt", "value": "Yes."}]},
    ]
    prompts = load_eval_prompts(write(tmp_path / "chat.jsonl", rows), tokenizer, max_prompts=2)
    expected = tokenizer.apply_chat_template(
        system_user, tokenize=False, add_generation_prompt=True
    )
    assert prompts.texts[0] == expected
    assert expected.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompts.token_ids[0] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert prompts.token_ids[0][0] == tokenizer.bos_token_id  # from the template, once
    assert "Numbers?" in prompts.texts[1] and "1 2 3" not in prompts.texts[1]
    assert len(prompts.token_ids) == 2  # --max-prompts stops reading
    assert prompts.skipped == {"no user turn before the first assistant turn": 1}


def test_long_prompts_are_skipped_and_no_prompt_is_an_error(tmp_path, tokenizer):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "word " * 50},
                {"from": "gpt", "value": "ok"},
            ]
        }
    ]
    path = write(tmp_path / "long.jsonl", rows)
    with pytest.raises(ValueError, match="no usable prompt"):
        load_eval_prompts(path, tokenizer, max_prompt_tokens=10)
    assert len(load_eval_prompts(path, tokenizer).token_ids) == 1
