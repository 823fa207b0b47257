"""`train --token-freq-path <datagen folder>` reads the folder's token_freq/ shards, as
`vocab-mapping --token-freq-path` does (#50 item 7: train refused the folder vocab-mapping took)."""

from __future__ import annotations

import pytest

from speculators_vllm016.data_generation.token_counts import (
    save_token_counts,
    shard_token_freq_path,
)
from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.train.vocab_maps import read_folder_token_counts, token_counts_for_training


def test_a_datagen_folder_gives_its_summed_shard_counts(tmp_path):
    folder = tmp_path / "d_regen"
    save_token_counts({1: 3, 2: 1}, shard_token_freq_path(folder, 0, 2))
    save_token_counts({2: 4, 7: 1}, shard_token_freq_path(folder, 1, 2))
    counts, source = token_counts_for_training(str(folder), tmp_path / "elsewhere")
    assert counts == {1: 3, 2: 5, 7: 1} == read_folder_token_counts(folder)
    assert source == str(folder)


def test_a_folder_without_counts_is_one_line_naming_the_flag(tmp_path):
    with pytest.raises(TrainSetupError, match=r"^--token-freq-path: no token counts in "):
        token_counts_for_training(str(tmp_path), tmp_path)
