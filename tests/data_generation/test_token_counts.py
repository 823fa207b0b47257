"""Datagen's per-shard token counts: summed, empty shards allowed, a damaged shard named."""

from __future__ import annotations

import pytest

from speculators_vllm016.data_generation.token_counts import (
    load_token_freq,
    save_token_counts,
    shard_token_freq_path,
)


def test_shards_are_summed_and_an_empty_shard_counts_nothing(tmp_path) -> None:
    save_token_counts({1: 2, 5: 1}, shard_token_freq_path(tmp_path, 0, 3))
    save_token_counts({}, shard_token_freq_path(tmp_path, 1, 3))  # a rank that saw no sample
    save_token_counts({5: 4}, shard_token_freq_path(tmp_path, 2, 3))
    assert load_token_freq(tmp_path) == {1: 2, 5: 5}


@pytest.mark.parametrize(
    "damage", [b"", b"not a checkpoint", None], ids=["empty file", "garbage", "a list"]
)
def test_a_damaged_shard_is_named(tmp_path, damage) -> None:
    save_token_counts({1: 2}, shard_token_freq_path(tmp_path, 0, 2))
    bad = shard_token_freq_path(tmp_path, 1, 2)
    if damage is None:
        import torch

        bad.parent.mkdir(parents=True, exist_ok=True)
        torch.save([1, 2], bad)
    else:
        bad.write_bytes(damage)
    with pytest.raises(ValueError, match=bad.name):
        load_token_freq(tmp_path)
