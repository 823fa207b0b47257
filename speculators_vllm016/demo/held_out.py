"""The demo's split of the shipped conversations: the target's, the drafts', and held-out prompts.

The evaluation must ask the target questions that neither it nor a draft has trained on, or a
draft's tau says how well it memorised its data. The shipped conversations are generated from
templates, so many rows open with the same question: holding out rows is not enough, the
questions themselves are held out. Of the distinct opening questions (the user turn the
evaluation prompts with, in order of first appearance) every `every`-th is held out; the first
row asking it goes to the held-out file (one evaluation prompt per question), and no row in
which any user turn asks a held-out question trains anything (those are set aside). The other
rows train the target (and its tokenizer); the first `draft_rows` of them are the conversations
both drafts train on (the shipped answers for one, the target's regenerated answers for the
other). Rows are written verbatim, so datagen, regeneration and evaluation read them as they
read the shipped file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from speculators_vllm016.utils.atomic_files import atomic_write_text
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "DRAFT_FILE",
    "HELD_OUT_FILE",
    "TARGET_FILE",
    "ConversationSplit",
    "RowQuestions",
    "check_every",
    "check_split",
    "row_questions",
    "split_of_file",
    "split_rows",
    "write_split",
]

TARGET_FILE = "target.jsonl"
DRAFT_FILE = "drafts.jsonl"
HELD_OUT_FILE = "held-out.jsonl"


@dataclass(frozen=True)
class RowQuestions:
    """What a row asks: the user turn an evaluation prompts with, and every user turn."""

    opening: str | None
    """None: a row the evaluation cannot prompt with (malformed, no user turn first)."""
    asked: frozenset[str]


@dataclass(frozen=True)
class ConversationSplit:
    """Row numbers (0-based, in the shipped file) of each part, and the held-out questions."""

    target: list[int]
    drafts: list[int]
    held_out: list[int]
    set_aside: list[int]
    """Rows that ask a held-out question but are not its evaluation row: used by nothing."""
    questions: list[str]


def row_questions(line: str) -> RowQuestions:
    """The questions of one JSONL row, read as datagen and the evaluation read it."""
    from speculators_vllm016.data_generation.conversations import (
        MalformedRowError,
        conversation_of,
        normalize_conversation,
    )
    from speculators_vllm016.evaluate.prompts import prompt_messages

    try:
        turns = conversation_of(json.loads(line))
        messages = normalize_conversation(turns)
        opening = prompt_messages(turns)[-1]["content"]
    except (json.JSONDecodeError, MalformedRowError, StopIteration):
        return RowQuestions(opening=None, asked=frozenset())
    asked = frozenset(m["content"] for m in messages if m["role"] == "user")
    return RowQuestions(opening=opening, asked=asked)


def split_rows(rows: list[RowQuestions], every: int, draft_rows: int | None) -> ConversationSplit:
    """Hold out every `every`-th distinct opening question (the `every`-th, the 2*`every`-th,
    ...); the drafts get the first `draft_rows` of the target's rows (None: all of them)."""
    distinct = list(dict.fromkeys(row.opening for row in rows if row.opening is not None))
    questions = distinct[every - 1 :: every]
    held = set(questions)
    first_row = {}
    for index, row in enumerate(rows):
        if row.opening in held:
            first_row.setdefault(row.opening, index)
    held_out = sorted(first_row.values())
    target = [i for i, row in enumerate(rows) if not row.asked & held]
    set_aside = [i for i, row in enumerate(rows) if row.asked & held and i not in held_out]
    drafts = target if draft_rows is None else target[:draft_rows]
    return ConversationSplit(target, drafts, held_out, set_aside, questions)


def check_split(split: ConversationSplit, draft_rows: int | None, eval_prompts: int) -> None:
    """Refuse, in one line naming the flag, a split that would cut something short silently."""
    if draft_rows is not None and not 1 <= draft_rows <= len(split.target):
        raise InvalidInputError(
            f"--max-samples must be between 1 and the {len(split.target)} conversations left "
            f"to train on once the held-out questions are set apart, got {draft_rows}"
        )
    if not 1 <= eval_prompts <= len(split.held_out):
        raise InvalidInputError(
            f"--eval-prompts must be between 1 and the {len(split.held_out)} held-out "
            f"questions, got {eval_prompts}; lower it or --held-out-every"
        )


def check_every(every: int) -> None:
    if every < 2:
        raise InvalidInputError(f"--held-out-every must be at least 2, got {every}")


def write_split(lines: list[str], split: ConversationSplit, folder: Path) -> dict[str, Path]:
    """Each part's rows, verbatim, into its own .jsonl file in `folder` (each written whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in (
        (TARGET_FILE, split.target),
        (DRAFT_FILE, split.drafts),
        (HELD_OUT_FILE, split.held_out),
    ):
        atomic_write_text(folder / name, "".join(lines[row].rstrip("\n") + "\n" for row in rows))
        paths[name] = folder / name
    return paths


def split_of_file(
    path: Path, every: int, draft_rows: int | None
) -> tuple[list[str], ConversationSplit]:
    """The non-blank lines of a .jsonl file and their split."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines, split_rows([row_questions(line) for line in lines], every, draft_rows)
