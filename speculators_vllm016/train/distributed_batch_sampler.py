"""Packing whole samples into fixed-size token rows, split evenly over data-parallel ranks.

Every optimizer step, each rank receives one list of sample indices whose lengths sum to at most
`batch_max_length` (the packed row). The packing of an epoch is a pure function of
`(lengths, seed + epoch, num_replicas)`: every rank computes the same plan and keeps its own share,
so ranks never share a sample and always run the same number of steps. Samples are taken in a
shuffled order; each step takes the longest run of the next samples that the longest-first greedy
rule can spread over the ranks within the budget. Samples left at the end of an epoch that cannot
give every rank one are dropped (as in 0.3.0).
"""

from __future__ import annotations

import copy
import heapq
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from torch.utils.data import Sampler

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["MultipackDistributedBatchSamplerV2", "pack_step"]

logger = logging.getLogger(__name__)


def pack_step(lengths: np.ndarray, budget: int, replicas: int) -> list[list[int]] | None:
    """Spread `lengths` over `replicas` bins of at most `budget`, longest first into the emptiest.

    Returns each bin's positions into `lengths` (longest first), or None when some sample does not
    fit. With at least `replicas` samples, no bin is left empty.
    """
    bins: list[list[int]] = [[] for _ in range(replicas)]
    heap = [(0, rank) for rank in range(replicas)]
    for position in np.argsort(-lengths, kind="stable"):
        fill, rank = heap[0]
        fill += int(lengths[position])
        if fill > budget:
            return None
        bins[rank].append(int(position))
        heapq.heapreplace(heap, (fill, rank))
    return bins


def _plan_epoch(lengths: np.ndarray, budget: int, replicas: int) -> list[list[list[int]]]:
    """The steps of one epoch over samples already in their shuffled order."""
    steps: list[list[list[int]]] = []
    cumulative = np.cumsum(lengths)
    start = 0
    total = len(lengths)
    while total - start >= replicas:
        consumed = int(cumulative[start - 1]) if start else 0
        # No step can hold more samples than fit in replicas * budget tokens.
        most = int(np.searchsorted(cumulative[start:], consumed + budget * replicas, "right"))
        most = max(most, replicas)
        # Largest count whose packing succeeds; `replicas` samples (one per bin) always fit.
        low, high = replicas, most
        best = pack_step(lengths[start : start + low], budget, replicas)
        while low < high:
            middle = (low + high + 1) // 2
            candidate = pack_step(lengths[start : start + middle], budget, replicas)
            if candidate is None:
                high = middle - 1
            else:
                low, best = middle, candidate
        assert best is not None
        steps.append([[start + position for position in members] for members in best])
        start += low
    return steps


class MultipackDistributedBatchSamplerV2(Sampler):
    """Batch sampler of packed rows; `len()` is the number of steps of an epoch on every rank.

    `lengths` are the token counts the collate function will pack (after the one-token shift).
    Samples longer than `batch_max_length` are cut to it (`truncate_long_samples=True`, the
    default) or dropped. `set_epoch(epoch, position)` starts an epoch at a given step, which is how
    an interrupted epoch resumes exactly.
    """

    def __init__(
        self,
        batch_max_length: int,
        lengths: ArrayLike,
        num_replicas: int,
        rank: int,
        truncate_long_samples: bool = True,
        seed: int = 0,
    ) -> None:
        if batch_max_length < 1:
            raise InvalidInputError(f"batch_max_length must be positive, got {batch_max_length}")
        if not 0 <= rank < num_replicas:
            raise InvalidInputError(f"rank {rank} is not in [0, {num_replicas})")
        self.batch_max_length = int(batch_max_length)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise InvalidInputError("lengths must be a flat sequence of sample lengths")
        too_long = self.lengths > self.batch_max_length
        self.valid_indices = np.arange(len(self.lengths))
        if too_long.any():
            count = int(too_long.sum())
            if truncate_long_samples:
                self.lengths = np.minimum(self.lengths, self.batch_max_length)
                action = f"cut to {self.batch_max_length} tokens"
            else:
                self.valid_indices = np.flatnonzero(~too_long)
                action = "dropped"
            if self.rank == 0:
                logger.warning(
                    "%d of %d samples are longer than the packed length %d: %s",
                    count,
                    len(self.lengths),
                    self.batch_max_length,
                    action,
                )
        # The last two epochs' plans: the loader reads one epoch ahead while the trainer asks
        # for the current one's length.
        self._plans: dict[int, list[list[int]]] = {}

    def set_epoch(self, epoch: int, position: int = 0) -> None:
        """Select the epoch (its shuffle) and the step to start from."""
        self.epoch = int(epoch)
        self.position = int(position)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's sample indices for every step of `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch not in self._plans:
            order = np.random.default_rng(self.seed + epoch).permutation(self.valid_indices)
            steps = _plan_epoch(self.lengths[order], self.batch_max_length, self.num_replicas)
            mine = [[int(order[position]) for position in step[self.rank]] for step in steps]
            while len(self._plans) >= 2:
                del self._plans[next(iter(self._plans))]
            self._plans[epoch] = mine
        return self._plans[epoch]

    def for_rank(self, rank: int) -> MultipackDistributedBatchSamplerV2:
        """A copy that plans rank `rank`'s batches (any rank's plan can be computed anywhere)."""
        other = copy.copy(self)
        other.rank, other._plans = int(rank), {}
        return other

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.position :])

    def __len__(self) -> int:
        return len(self.batches())

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise InvalidInputError(f"sampler seed {state['seed']} != {self.seed}: a different run")
        self.set_epoch(state["epoch"], state["position"])
