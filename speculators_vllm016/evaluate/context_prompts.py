"""Long evaluation prompts built from the user's own chats, to measure acceptance against context.

A draft is served where prompts are long (agentic sessions, earlier turns of a chat), and its
acceptance there is what it is worth. At context length L, evaluation question i (the same
question as at the short prompt: conversation i up to its first answer) is asked after earlier
turns of the other conversations of the same data: the user/assistant pairs of conversations
i + 1, i + 2, ... (in file order, wrapping round, never i itself), whole pairs while the rendered
prompt stays within L tokens (a pair too long for what is left is passed over), chosen by
`data_generation.sessions`, the code that chains training sessions (`--session-tokens`).
Deterministic: the same data and tokenizer give the same prompts. A data set too small to reach
L gives shorter prompts, and the report shows the mean length reached beside L (nothing is cut
inside a turn).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from transformers import PreTrainedTokenizerBase

from speculators_vllm016.data_generation.conversations import (
    MalformedRowError,
    normalize_conversation,
)
from speculators_vllm016.data_generation.preprocessing import (
    _ensure_conversations,
    load_raw_dataset,
)
from speculators_vllm016.data_generation.sessions import (
    Message,
    fill_with_pairs,
    fit_whole,
    turn_pairs,
)
from speculators_vllm016.evaluate.prompts import prompt_messages
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["ContextPrompts", "context_prompt_sets", "parse_context_lengths"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextPrompts:
    """The evaluation prompts at one context length (0: each question alone; None: the plain
    prompts of a run without context lengths)."""

    context_length: int | None
    token_ids: list[list[int]]

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(map(len, self.token_ids)) / max(len(self.token_ids), 1)


def parse_context_lengths(text: str) -> list[int]:
    """`"0,450,1750"` -> `[0, 450, 1750]` (sorted, distinct); errors name `--context-lengths`."""
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidInputError(
            f"--context-lengths takes comma-separated token counts (e.g. 0,1000,4000), got {text!r}"
        ) from None
    if not lengths or lengths[0] < 0:
        raise InvalidInputError(
            f"--context-lengths needs token counts of 0 or more (0: the question alone), got {text!r}"
        )
    return lengths


def _conversations(data_path: str, cache_dir: str | None) -> list[list[Message]]:
    """Every row of the data in one message shape; malformed rows are left out (as eval does)."""
    dataset = _ensure_conversations(
        load_raw_dataset(data_path, num_proc=1, cache_dir=cache_dir, flag="--data-path")
    )
    rows = []
    for turns in dataset["conversations"]:
        try:
            rows.append(normalize_conversation(turns))
        except MalformedRowError:
            rows.append([])
    return rows


def _history(rows: list[list[Message]], question: int) -> Iterator[list[Message]]:
    """The turn pairs that may come before question `question`: the other rows, from the next."""
    for step in range(1, len(rows)):
        yield from turn_pairs(rows[(question + step) % len(rows)])


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _long_prompt(
    tokenizer: PreTrainedTokenizerBase,
    rows: list[list[Message]],
    question: int,
    asked: list[Message],
    length: int,
) -> list[int]:
    """Question `question` (its messages `asked`) after earlier pairs, within `length` tokens.

    The pairs are chosen by `data_generation.sessions` (the code that chains training sessions),
    each costed by what it adds in front of the question alone (a template's own header counted
    once); the prompt is then rendered whole and the last pairs dropped while it is over.
    """
    system = [m for m in asked if m["role"] == "system"]
    question_part = [m for m in asked if m["role"] != "system"]
    alone = len(_render(tokenizer, system + question_part))

    def cost(pair: list[Message]) -> int:
        return len(_render(tokenizer, system + pair + question_part)) - alone

    chosen = fill_with_pairs(_history(rows, question), cost, length - alone)
    return fit_whole(chosen, partial(_render, tokenizer), length, system, question_part)


def context_prompt_sets(
    data_path: str,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[int],
    questions: Sequence[int],
    cache_dir: str | None = None,
) -> list[ContextPrompts]:
    """The prompts at each of `lengths` for the questions of rows `questions` (row indices of
    the data, as `load_eval_prompts` chose them); length 0 is each question alone."""
    rows = _conversations(data_path, cache_dir)
    sets = []
    for length in lengths:
        token_ids = []
        for question in questions:
            asked = prompt_messages(rows[question])
            if length == 0:
                token_ids.append(_render(tokenizer, asked))
            else:
                token_ids.append(_long_prompt(tokenizer, rows, question, asked, length))
        prompts = ContextPrompts(length, token_ids)
        if length and prompts.mean_prompt_tokens < 0.9 * length:
            logger.warning(
                "the prompts at context length %d reach %.0f tokens on average: %s holds too few "
                "other turns to fill them",
                length,
                prompts.mean_prompt_tokens,
                data_path,
            )
        sets.append(prompts)
    return sets
