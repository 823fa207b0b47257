"""Named datasets that `--train-data-path` accepts besides local json/jsonl files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speculators_vllm016.data_generation.conversations import conversation_of

__all__ = ["DATASET_CONFIGS", "DatasetConfig"]


@dataclass
class DatasetConfig:
    """Where a named dataset lives on the Hugging Face hub and how to bring it to our shape."""

    name: str
    hf_path: str
    split: str
    normalize_fn: Callable[[dict], dict] | None = None


def _messages_to_conversations(example: dict) -> dict:
    # UltraChat keeps its turns under "messages"; the pipeline reads "conversations".
    return {"conversations": conversation_of(example)}


DATASET_CONFIGS: dict[str, DatasetConfig] = {
    "sharegpt": DatasetConfig(
        name="sharegpt", hf_path="Aeala/ShareGPT_Vicuna_unfiltered", split="train"
    ),
    "ultrachat": DatasetConfig(
        name="ultrachat",
        hf_path="HuggingFaceH4/ultrachat_200k",
        split="train_sft",
        normalize_fn=_messages_to_conversations,
    ),
}
