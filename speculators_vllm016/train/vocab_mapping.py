"""Token frequencies of the training data and the draft vocabulary built from them."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset as HFDataset

# Counting and the count files live in data_generation.token_counts (datagen counts too); the
# 0.3.0 names below are kept here on top of them.
from speculators_vllm016.data_generation.token_counts import (
    count_trained_tokens,
    save_token_counts,
    sum_token_counts,
)
from speculators_vllm016.train.jobs.vocab_size_rule import draft_vocab_too_large
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "build_vocab_mappings_from_distribution",
    "save_token_frequency_distribution",
]


def save_token_frequency_distribution(
    dataset: HFDataset, output_path: str = "./token_freq.pt"
) -> str:
    """Write `{token_id: count}` over the trained tokens to `output_path` (atomically).

    Always recomputed: a file left from another dataset is replaced, not reused.
    """
    save_token_counts(count_trained_tokens(dataset), output_path)
    return output_path


def combine_token_frequency_distributions(
    token_freq_paths: list[str | Path], output_path: str | Path
) -> None:
    """Sum several `token_freq.pt` files (e.g. one per shard) into one."""
    save_token_counts(sum_token_counts(token_freq_paths), output_path)


def build_vocab_mappings_from_distribution(
    token_freq_dict: dict[int, int], draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t, t2d)` for the `draft_vocab_size` most frequent tokens (ties: lower id first).

    `t2d[target_id]` is True for kept tokens; `target_id = draft_id + d2t[draft_id]`. When the
    data has fewer distinct tokens than the draft vocabulary, the lowest unused ids fill it.
    """
    if draft_vocab_size > target_vocab_size:
        raise InvalidInputError(draft_vocab_too_large(draft_vocab_size, target_vocab_size))
    ranked = sorted(
        (token for token in token_freq_dict if 0 <= int(token) < target_vocab_size),
        key=lambda token: (-token_freq_dict[token], int(token)),
    )
    chosen = [int(token) for token in ranked[:draft_vocab_size]]
    if len(chosen) < draft_vocab_size:
        taken = set(chosen)
        filler = (token for token in range(target_vocab_size) if token not in taken)
        chosen += [next(filler) for _ in range(draft_vocab_size - len(chosen))]
    kept = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
