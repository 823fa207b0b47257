"""The main job on an embedded default: datagen on a tiny local model and shipped conversations.

Fully offline: the model and its tokenizer are built on first use (seconds) into the output folder,
and the conversations ship inside this package.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

__all__ = ["CONVERSATIONS", "build_demo_model", "demo_conversations_path"]

CONVERSATIONS = "conversations.jsonl"


def demo_conversations_path() -> Path:
    return Path(str(resources.files(__name__).joinpath(CONVERSATIONS)))


def _corpus() -> list[str]:
    texts = []
    with open(demo_conversations_path()) as handle:
        for line in handle:
            for turn in json.loads(line)["conversations"]:
                texts.append(turn["value"])
    return texts


def build_demo_model(path: str | Path) -> Path:
    """The demo target: a Llama of 8 layers (hidden 256) with a tokenizer trained on the data."""
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
        max_position_embeddings=2048,
        corpus=_corpus(),
    )
