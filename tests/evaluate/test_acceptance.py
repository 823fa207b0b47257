"""Acceptance counters: vLLM's definitions of tau and per-position rates."""

from __future__ import annotations

import pytest

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts


def test_counts_tau_and_rates_as_vllm_defines_them():
    counts = AcceptanceCounts(3)
    for accepted in (3, 1, 0, 2):
        counts.observe(3, accepted)
    assert counts.num_drafts == 4 and counts.num_draft_tokens == 12
    assert counts.num_accepted_tokens == 6
    assert counts.accepted_per_position == [3, 2, 1]
    assert counts.acceptance_length == pytest.approx(1 + 6 / 4)
    assert counts.per_position_rates == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert counts.draft_acceptance_rate == pytest.approx(6 / 12)
    # tau is 1 + the sum of the per-position rates.
    assert counts.acceptance_length == pytest.approx(1 + sum(counts.per_position_rates))


def test_merge_adds_and_empty_counts_are_neutral():
    first, second = AcceptanceCounts(2), AcceptanceCounts(2)
    first.observe(2, 2)
    second.observe(2, 0)
    second.observe(2, 1)
    first.merge(second)
    assert (first.num_drafts, first.num_accepted_tokens, first.accepted_per_position) == (
        3,
        3,
        [2, 1],
    )
    empty = AcceptanceCounts(2)
    assert empty.acceptance_length == 1.0 and empty.per_position_rates == [0.0, 0.0]
    with pytest.raises(ValueError, match="cannot merge"):
        first.merge(AcceptanceCounts(3))


def test_impossible_observations_are_refused():
    counts = AcceptanceCounts(2)
    with pytest.raises(ValueError, match="accepted"):
        counts.observe(2, 3)
    with pytest.raises(ValueError, match="at least 1"):
        AcceptanceCounts(0)
