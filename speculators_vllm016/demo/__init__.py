"""The main job on an embedded default: datagen on a tiny local model and shipped conversations.

Fully offline: the model and its tokenizer are built on first use (seconds) into the output folder,
and the conversations ship inside this package.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from speculators_vllm016.data_generation.conversations import (
    MalformedRowError,
    conversation_of,
    normalize_conversation,
)

__all__ = ["CONVERSATIONS", "build_demo_model", "demo_conversations_path", "read_conversations"]

logger = logging.getLogger(__name__)

CONVERSATIONS = "conversations.jsonl"
MAX_POSITIONS = 2048
"""The demo target's positions: its prompts and answers (`--long-context` too) fit within them."""


def demo_conversations_path() -> Path:
    return Path(str(resources.files(__name__).joinpath(CONVERSATIONS)))


def read_conversations(path: str | Path) -> Iterator[list[dict[str, str]]]:
    """Each usable conversation of a .jsonl file as `[{"role", "content"}]`, read as datagen reads
    a row; rows datagen would skip are skipped (and counted in a warning)."""
    skipped = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                yield normalize_conversation(conversation_of(json.loads(line)))
            except (json.JSONDecodeError, MalformedRowError):
                skipped += 1
    if skipped:
        logger.warning("skipped %d malformed conversations of %s", skipped, path)


def _corpus(conversations: str | Path) -> list[str]:
    return [
        message["content"] for messages in read_conversations(conversations) for message in messages
    ]


def build_demo_model(path: str | Path, conversations: str | Path | None = None) -> Path:
    """The demo target: a Llama of 8 layers (hidden 256) with a tokenizer trained on the data
    (`conversations`, default the shipped file: the demo passes its training part only)."""
    from speculators_vllm016.tiny_models import build_tiny_llama

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    return build_tiny_llama(
        path,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        vocab_size=1024,
        max_position_embeddings=MAX_POSITIONS,
        corpus=_corpus(conversations or demo_conversations_path()),
    )
