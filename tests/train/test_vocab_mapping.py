"""The draft vocabulary: which target tokens it keeps, and the maps between the two vocabularies."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution


def kept_tokens(d2t: torch.Tensor) -> list[int]:
    """Target ids of the draft vocabulary, in draft-id order (`target = draft + d2t[draft]`)."""
    return (torch.arange(len(d2t)) + d2t).tolist()


def test_keeps_the_most_frequent_tokens():
    # Frequency falls with the id for even ids; odd ids are rare. Counts are all distinct.
    frequencies = {
        token: (1000 - token if token % 2 == 0 else token // 2 + 1) for token in range(40)
    }
    d2t, t2d = build_vocab_mappings_from_distribution(
        frequencies, draft_vocab_size=6, target_vocab_size=50
    )
    assert kept_tokens(d2t) == [0, 2, 4, 6, 8, 10]
    assert t2d.dtype == torch.bool and t2d.shape == (50,)
    assert t2d.nonzero().flatten().tolist() == [0, 2, 4, 6, 8, 10]
    assert d2t.dtype == torch.long and d2t.tolist() == [0, 1, 2, 3, 4, 5]


def test_draft_ids_follow_target_order_whatever_the_frequency_order():
    frequencies = {30: 5, 7: 50, 12: 9, 3: 1, 25: 40}
    d2t, t2d = build_vocab_mappings_from_distribution(
        frequencies, draft_vocab_size=3, target_vocab_size=32
    )
    # Kept: 7 (50), 25 (40), 12 (9); draft ids in increasing target id.
    assert kept_tokens(d2t) == [7, 12, 25]
    assert d2t.tolist() == [7, 11, 23]
    assert t2d.nonzero().flatten().tolist() == [7, 12, 25]


def test_ties_keep_the_lower_id_and_unused_ids_fill_a_short_distribution():
    d2t, _ = build_vocab_mappings_from_distribution({9: 3, 4: 3, 6: 3, 2: 1}, 2, 16)
    assert kept_tokens(d2t) == [4, 6]
    # Four distinct tokens for a draft vocabulary of six: the lowest ids not yet taken fill it.
    d2t, t2d = build_vocab_mappings_from_distribution({9: 3, 4: 3, 6: 3, 2: 1}, 6, 16)
    assert kept_tokens(d2t) == [0, 1, 2, 4, 6, 9]
    assert int(t2d.sum()) == 6


def test_tokens_outside_the_target_vocabulary_are_ignored_and_too_large_a_draft_is_refused():
    d2t, _ = build_vocab_mappings_from_distribution({100: 1000, 3: 5, 1: 2}, 2, 10)
    assert kept_tokens(d2t) == [1, 3]
    with pytest.raises(
        ValueError,
        match="--draft-vocab-size 11 is larger than the target's vocabulary of 10 tokens",
    ):
        build_vocab_mappings_from_distribution({1: 1}, 11, 10)
