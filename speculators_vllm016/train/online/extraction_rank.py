"""An extraction rank of a split online run: answer the training ranks until they are done.

    request (iteration, epoch, step) from training rank r
      -> the plan of that iteration and epoch: every training rank's samples of every step (the
         sampler's plan, computed here from the same lengths and seed as on the training ranks)
      -> this rank's steps from there on (`step % K == this rank`), extracted ahead by the
         producer thread, one engine call per batch of steps, into a bounded queue
      -> rank r's samples of the step, sent as raw tensors; the step is dropped once every
         training rank has its part.

The requests carry everything that fixes the samples, so the extraction ranks keep no training
state: a resumed run simply asks from where it stands. Samples already in the --cache-dir folder are
read from it instead of extracted. After a failure (the engine or its worker died, the cache disk
is full) every later request is answered with the failure's message, so the training ranks all
stop at the same step and checkpoint; the rank returns once every training rank said it is done.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from speculators_vllm016.train.online.loader import (
    PRODUCER_END,
    OnlineExtractor,
    ProducerFailure,
    as_source_error,
)
from speculators_vllm016.train.online.rank_layout import RankLayout
from speculators_vllm016.train.online.sample_transport import (
    DONE,
    SampleRequest,
    StepSamples,
    Transport,
)
from speculators_vllm016.utils.errors import type_and_first_line

__all__ = ["SUMMARY_PREFIX", "ExtractionServer", "IterationPlan", "PlanSource"]

SUMMARY_PREFIX = "extraction rank summary: "

logger = logging.getLogger(__name__)


@dataclass
class PlanSource:
    """One loader's sampler (any training rank's; each rank's plan comes from a copy) and the
    datagen index of each dataset position it plans."""

    sampler: Any
    indices: list[int]


@dataclass
class IterationPlan:
    """Every training rank's samples of every step of one loader iteration (one epoch)."""

    per_rank: list[list[list[int]]]
    """`per_rank[r][s]`: training rank r's dataset positions of step s."""
    union: list[list[int]] = field(init=False)
    """Step s's positions over every rank, each once."""

    def __post_init__(self) -> None:
        steps = len(self.per_rank[0]) if self.per_rank else 0
        self.union = [
            list(dict.fromkeys(item for plan in self.per_rank for item in plan[s]))
            for s in range(steps)
        ]

    @classmethod
    def of(cls, source: PlanSource, epoch: int, training_ranks: int) -> IterationPlan:
        plans = []
        for rank in range(training_ranks):
            plans.append([list(step) for step in source.sampler.for_rank(rank).batches(epoch)])
        return cls(plans)


class ExtractionServer:
    """The extraction rank's loop (`serve`); see the module docstring."""

    def __init__(
        self,
        layout: RankLayout,
        transport: Transport,
        extractor: OnlineExtractor,
        sources: dict[int, PlanSource],
        queue_size: int,
    ) -> None:
        self.layout, self.transport, self.extractor = layout, transport, extractor
        self.sources, self.queue_size = sources, queue_size
        self.failure: str | None = None
        self._key: tuple[int, int] | None = None
        self._plan: IterationPlan | None = None
        self._producer: Any = None
        self._upcoming: deque[int] = deque()  # steps the producer will still put, in order
        self._ready: dict[int, tuple[dict[int, Any], set[int]]] = {}  # step -> (row, ranks owed)
        self._cached: set[int] = set()
        self.served_steps = 0
        self.request_wait = 0.0  # seconds with nothing asked of this rank (the trainers were busy)

    def serve(self) -> None:
        """Answer requests until every training rank said it is done."""
        done: set[int] = set()
        started = time.perf_counter()
        try:
            while len(done) < self.layout.training_world_size:
                waiting = time.perf_counter()
                request = self.transport.next_request()
                self.request_wait += time.perf_counter() - waiting
                if request.kind == DONE:
                    done.add(request.source)
                    continue
                self.transport.answer(request.source, self._answer(request))
        finally:
            self.extractor.stop_producer()
        seconds = time.perf_counter() - started
        logger.info(
            "extraction rank %d: %d requests of steps answered, %.1f MB sent (%.1f MB/s), %d samples "
            "extracted%s",
            self.layout.rank,
            self.served_steps,
            self.transport.bytes_moved / 1e6,
            self.transport.bytes_moved / 1e6 / max(seconds, 1e-9),
            self.extractor.stats.extracted_samples,
            f"; stopped by: {self.failure}" if self.failure else "",
        )
        logger.info("%s%s", SUMMARY_PREFIX, json.dumps(self.summary(seconds)))

    def summary(self, seconds: float) -> dict[str, Any]:
        """This rank's figures (one JSON log line, for benchmarks/online.py)."""
        stats = self.extractor.stats
        return {
            "rank": self.layout.rank,
            "seconds": round(seconds, 3),
            "bytes_sent": self.transport.bytes_moved,
            "extracted_samples": stats.extracted_samples,
            "extracted_tokens": stats.extracted_tokens,
            "extraction_seconds": round(stats.extraction_seconds, 3),
            "waited_for_room_seconds": round(stats.producer_wait, 3),
            "waited_for_requests_seconds": round(self.request_wait, 3),
            "engine_starts": stats.engine_starts,
            "failure": self.failure,
        }

    # -- one request ---------------------------------------------------------------------------
    def _answer(self, request: SampleRequest) -> StepSamples:
        if self.failure is None:
            try:
                row = self._row(request)
                rank = request.source - self.layout.extraction_ranks
                assert self._plan is not None
                mine = self._plan.per_rank[rank][request.step]
                samples = {item: row[item] for item in mine}
                self._served(request.step, rank)
                self.served_steps += 1
                return StepSamples(samples=samples)
            except Exception as error:  # noqa: BLE001 - every training rank is told, then stops
                self.failure = (
                    f"extraction rank {self.layout.rank}: {_describe(error, self.extractor)}"
                )
                logger.error("%s", self.failure)
                self.extractor.stop_producer()
        return StepSamples(failure=self.failure)

    def _row(self, request: SampleRequest) -> dict[int, Any]:
        """Every training rank's samples of the requested step (position -> raw sample)."""
        key = (request.iteration, request.epoch)
        if key != self._key or (
            request.step not in self._ready and request.step not in self._upcoming
        ):
            self._start(key, request.step)
        while request.step not in self._ready:
            step = self._upcoming.popleft()
            got = self._producer.rows.get()
            if isinstance(got, ProducerFailure):
                raise got.error
            if got is PRODUCER_END:
                raise RuntimeError("the extraction ended before the epoch's last step")
            self._ready[step] = (
                self._complete(step, got),
                set(range(self.layout.training_world_size)),
            )
        return self._ready[request.step][0]

    def _served(self, step: int, rank: int) -> None:
        owed = self._ready[step][1]
        owed.discard(rank)
        if not owed:
            del self._ready[step]

    def _start(self, key: tuple[int, int], first_step: int) -> None:
        """This rank's steps of iteration `key` from `first_step` on, extracted ahead."""
        self.extractor.stop_producer()
        iteration, epoch = key
        source = self.sources[iteration]
        self._key, self._ready = key, {}
        self._plan = IterationPlan.of(source, epoch, self.layout.training_world_size)
        extraction_ranks = self.layout.extraction_ranks
        mine = [
            step
            for step in range(first_step, len(self._plan.union))
            if step % extraction_ranks == self.layout.rank
        ]
        self._upcoming = deque(mine)
        self._cached = self.extractor.cached()
        need = {
            item
            for step in mine
            for item in self._plan.union[step]
            if source.indices[item] not in self._cached
        }
        steps = [self._plan.union[step] for step in mine]
        if need:
            self.extractor.ensure_engine()
        self._producer = self.extractor.start_producer(steps, source.indices, need, self.queue_size)

    def _complete(self, step: int, row: dict[int, Any]) -> dict[int, Any]:
        """The producer's row plus the step's samples read from the cache folder."""
        from speculators_vllm016.data_generation.sample_io import load_sample

        assert self._plan is not None and self._key is not None
        indices = self.sources[self._key[0]].indices
        for item in self._plan.union[step]:
            if item not in row:
                row[item] = load_sample(self.extractor.sample_path(indices[item]))
        return row


def _describe(error: BaseException, extractor: OnlineExtractor) -> str:
    if isinstance(error, (ProducerFailure,)):
        error = error.error
    try:
        return str(as_source_error(error, extractor))
    except Exception:  # noqa: BLE001 - the message is what matters
        return type_and_first_line(error)
