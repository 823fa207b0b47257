"""Evaluation prompts from a chat dataset: each conversation up to its first assistant turn.

The files datagen reads (ShareGPT or messages shape, .json/.jsonl, or a named dataset) are read by
datagen's own loader; the prompt is rendered with the tokenizer's chat template and its generation
prompt, so the model answers as it would in a chat server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from speculators_vllm016.data_generation.conversations import (
    MalformedRowError,
    normalize_conversation,
    skip_reason,
)
from speculators_vllm016.data_generation.preprocessing import (
    _ensure_conversations,
    load_raw_dataset,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["EvalPrompts", "load_eval_prompts", "prompt_messages"]

logger = logging.getLogger(__name__)


@dataclass
class EvalPrompts:
    """Token ids of the prompts, and how many rows were passed over and why."""

    token_ids: list[list[int]]
    texts: list[str]
    skipped: dict[str, int]
    rows: list[int] = field(default_factory=list)
    """The data row of each prompt (its index in the file), for prompts built around them."""


def prompt_messages(turns: object) -> list[dict[str, str]]:
    """The conversation's turns before its first assistant turn (at least one user turn)."""
    messages = normalize_conversation(turns)
    first_answer = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
    prompt = messages[:first_answer]
    if not any(message["role"] == "user" for message in prompt):
        raise MalformedRowError("no user turn before the first assistant turn")
    return prompt


def load_eval_prompts(
    data_path: str,
    tokenizer: PreTrainedTokenizerBase,
    max_prompts: int | None = None,
    max_prompt_tokens: int | None = None,
    cache_dir: str | None = None,
) -> EvalPrompts:
    """The first `max_prompts` usable prompts of `data_path`, in file order.

    Rows that are malformed, or whose prompt is longer than `max_prompt_tokens`, are skipped and
    counted. Raises `ValueError` when no prompt is left.
    """
    if tokenizer.chat_template is None:
        raise InvalidInputError("the verifier's tokenizer has no chat template; prompts need one")
    if max_prompts is not None and max_prompts < 1:
        raise InvalidInputError(f"max_prompts must be at least 1, got {max_prompts}")
    dataset = _ensure_conversations(
        load_raw_dataset(data_path, num_proc=1, cache_dir=cache_dir, flag="--data-path")
    )
    token_ids: list[list[int]] = []
    texts: list[str] = []
    skipped: dict[str, int] = {}
    rows: list[int] = []
    for row, turns in enumerate(dataset["conversations"]):
        if max_prompts is not None and len(token_ids) >= max_prompts:
            break
        try:
            messages = prompt_messages(turns)
        except MalformedRowError as error:
            reason = skip_reason(str(error))
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            reason = f"prompt longer than {max_prompt_tokens} tokens"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        token_ids.append(list(ids))
        texts.append(text)
        rows.append(row)
    if skipped:
        logger.warning("skipped %d rows of %s: %s", sum(skipped.values()), data_path, skipped)
    if not token_ids:
        raise InvalidInputError(
            f"{data_path} holds no usable prompt (skipped: {skipped or 'none'})"
        )
    return EvalPrompts(token_ids=token_ids, texts=texts, skipped=skipped, rows=rows)
