"""Token counts of a datagen run, kept beside its samples, one file per shard.

`<data>/token_freq/shard-{I}-of-{N}.pth` holds `{token_id: count}` over the trained tokens of
shard I's rows (a torch-saved dict, as 0.3.0's `token_freq.pt`). The suffix is not "pt" on
purpose: 0.3.0's trainer reads every file ending in "pt" under the data folder as a sample.
Summing the shards' files gives the counts of the whole data set.

This is the one home of token counting and of the count files: datagen, online training's cache
and `train.vocab_mapping` (0.3.0's public names) all count and save through here.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from speculators_vllm016.utils.atomic_files import atomic_torch_save
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from datasets import Dataset as HFDataset

__all__ = [
    "TOKEN_FREQ_DIR",
    "count_trained_tokens",
    "load_token_freq",
    "read_token_counts",
    "save_token_counts",
    "shard_token_freq_path",
    "sum_token_counts",
]

TOKEN_FREQ_DIR = "token_freq"


def shard_token_freq_path(data_dir: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    return Path(data_dir) / TOKEN_FREQ_DIR / f"shard-{shard_index}-of-{num_shards}.pth"


def count_trained_tokens(dataset: HFDataset) -> Counter[int]:
    """How often each token id appears where `loss_mask` is 1."""
    counts: Counter[int] = Counter()
    for input_ids, loss_mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        ids = torch.as_tensor(input_ids)
        mask = torch.as_tensor(loss_mask).bool()
        unique, frequency = ids[mask].unique(return_counts=True)
        counts.update(dict(zip(unique.tolist(), frequency.tolist())))
    return counts


def save_token_counts(counts: dict[int, int], path: str | os.PathLike) -> Path:
    """Write atomically, readable as any file the user writes (the umask decides, not 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_torch_save(dict(counts), path)


def read_token_counts(path: str | os.PathLike, allow_empty: bool = False) -> dict[int, int]:
    """One `{token_id: count}` file (0.3.0's `token_freq.pt`, one written by `vocab-mapping`, or
    one of datagen's shards, which may be empty: `allow_empty`).

    `ValueError` naming the file when it is not one: unreadable (pickle, zip or EOF errors; the
    original error is the cause), or not a mapping (a non-empty one unless `allow_empty`).
    """
    from speculators_vllm016.utils.errors import type_and_first_line

    try:
        counts = torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and EOF errors alike: not our file
        raise InvalidInputError(
            f"{path} is not a readable token frequency file ({type_and_first_line(error)})"
        ) from error
    if not isinstance(counts, dict) or not (counts or allow_empty):
        raise InvalidInputError(f"{path} is not a non-empty {{token_id: count}} mapping")
    return {int(token): int(count) for token, count in counts.items()}


def load_token_freq(data_dir: str | os.PathLike) -> dict[int, int]:
    """The summed counts of every shard file in `data_dir`; refuses a set with shards missing,
    and names a shard that is not a readable mapping (`ValueError`)."""
    folder = Path(data_dir) / TOKEN_FREQ_DIR
    files = sorted(folder.glob("shard-*-of-*.pth")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no token counts in {folder}; run datagen into {data_dir} first")
    totals = {int(f.stem.rsplit("-of-", 1)[1]) for f in files}
    if len(totals) != 1 or len(files) != next(iter(totals)):
        names = ", ".join(f.name for f in files)
        raise InvalidInputError(f"{folder} holds an incomplete or mixed set of shards ({names})")
    return sum_token_counts(files)


def sum_token_counts(paths: Iterable[str | os.PathLike]) -> dict[int, int]:
    """The summed counts of several count files (e.g. one per shard); empty ones count as 0."""
    total: Counter[int] = Counter()
    for path in paths:
        total.update(read_token_counts(path, allow_empty=True))
    return dict(total)
