"""Packing whole samples into rows, evenly over ranks, deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from speculators_vllm016.train.distributed_batch_sampler import (
    MultipackDistributedBatchSamplerV2,
    pack_step,
)


def lengths_for(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 400, size=count)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_ranks_are_disjoint_equal_in_steps_and_within_budget(replicas):
    lengths = lengths_for(500)
    budget = 1024
    samplers = [
        MultipackDistributedBatchSamplerV2(budget, lengths, replicas, rank, seed=3)
        for rank in range(replicas)
    ]
    plans = [list(sampler) for sampler in samplers]
    assert len({len(plan) for plan in plans}) == 1 and len(plans[0]) > 0
    seen: list[int] = []
    for plan in plans:
        for batch in plan:
            assert batch, "every rank gets at least one sample per step"
            assert lengths[batch].sum() <= budget
            seen.extend(batch)
    assert len(seen) == len(set(seen)), "a sample went to two ranks or twice to one"
    # Only the tail that cannot give every rank a sample is dropped.
    assert len(seen) > len(lengths) - replicas * 8


def test_rows_are_well_filled():
    lengths = lengths_for(400)
    sampler = MultipackDistributedBatchSamplerV2(2048, lengths, 2, 0, seed=0)
    fills = [lengths[batch].sum() / 2048 for batch in sampler]
    assert np.median(fills) > 0.85


def test_deterministic_for_seed_and_epoch_and_different_across_epochs():
    lengths = lengths_for(300)
    first = MultipackDistributedBatchSamplerV2(1024, lengths, 2, 1, seed=7)
    again = MultipackDistributedBatchSamplerV2(1024, lengths, 2, 1, seed=7)
    assert list(first) == list(again)
    first.set_epoch(1)
    epoch_one = list(first)
    assert epoch_one != list(again)
    again.set_epoch(1)
    assert list(again) == epoch_one
    other_seed = MultipackDistributedBatchSamplerV2(1024, lengths, 2, 1, seed=8)
    assert list(other_seed) != list(MultipackDistributedBatchSamplerV2(1024, lengths, 2, 1, seed=7))


def test_start_position_resumes_the_same_plan():
    lengths = lengths_for(200)
    sampler = MultipackDistributedBatchSamplerV2(1024, lengths, 1, 0, seed=1)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.set_epoch(2, position=5)
    assert list(sampler) == whole[5:]
    assert len(sampler) == len(whole)
    restored = MultipackDistributedBatchSamplerV2(1024, lengths, 1, 0, seed=1)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == whole[5:]
    with pytest.raises(ValueError, match="seed"):
        MultipackDistributedBatchSamplerV2(1024, lengths, 1, 0, seed=2).load_state_dict(
            sampler.state_dict()
        )


def test_long_samples_are_cut_to_the_budget_or_dropped():
    lengths = np.array([50, 3000, 60, 70, 80, 2000])
    cut = MultipackDistributedBatchSamplerV2(1000, lengths, 1, 0)
    assert cut.lengths.max() == 1000
    assert sorted(i for batch in cut for i in batch) == list(range(6))
    dropped = MultipackDistributedBatchSamplerV2(1000, lengths, 1, 0, truncate_long_samples=False)
    assert sorted(i for batch in dropped for i in batch) == [0, 2, 3, 4]


def test_pack_step_refuses_what_does_not_fit_and_fills_every_bin():
    assert pack_step(np.array([600, 600, 600]), 1000, 2) is None
    bins = pack_step(np.array([500, 400, 300, 200, 100]), 1000, 2)
    assert bins is not None and all(bins)
    totals = [sum([500, 400, 300, 200, 100][i] for i in members) for members in bins]
    assert max(totals) <= 1000 and sum(totals) == 1500
