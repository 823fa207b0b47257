"""A training rank's loader in a split online run: each step's samples come from that step's
extraction rank (`rank_layout`), as raw tensors (`sample_transport`).

The data -> trainer contract is offline's (`train.data`): this rank's steps are its sampler's plan,
the samples of each step are prepared by the same `Eagle3SampleFileDataset.item` (noise seeded per
sample, drawn where the row is) and packed by the same collate function, so the rows equal what
offline training with the same number of training ranks reads from datagen's files.

A receiver thread asks for the next steps ahead of the trainer (at most `queue_size` rows wait in
memory). Before each row is handed over, the training ranks agree that every one of them has its
row: if an extraction rank failed (or died), all of them raise the same `ExtractionFailed` at the
same step, and the trainer checkpoints there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from speculators_vllm016.train.data import Eagle3SampleFileDataset, PackedBatch
from speculators_vllm016.train.loading.loader_contract import (
    ReportsProgress,
    ReportsStepMetrics,
    TrainingLoader,
)
from speculators_vllm016.train.online.errors import ExtractionFailed
from speculators_vllm016.train.online.rank_layout import RankLayout
from speculators_vllm016.train.online.sample_transport import (
    REQUEST,
    SampleRequest,
    StepSamples,
    Transport,
)
from speculators_vllm016.utils.errors import type_and_first_line

__all__ = ["RemoteSampleLoader", "TRAIN_ITERATION", "VALIDATION_ITERATION", "finish_extraction"]

TRAIN_ITERATION, VALIDATION_ITERATION = 0, 1


class RemoteSampleLoader(TrainingLoader, ReportsProgress, ReportsStepMetrics):
    """What the trainer needs of a DataLoader (`TrainingLoader`): `batch_sampler`, `dataset`,
    `len()`, iteration; and the transfer's figures for the progress bar (`progress_fields`) and
    the metrics (`step_metrics`)."""

    def __init__(
        self,
        layout: RankLayout,
        transport: Transport,
        dataset: Eagle3SampleFileDataset,
        batch_sampler: Any,
        collate_fn: Any,
        iteration: int,
        queue_size: int,
        collective_device: torch.device,
    ) -> None:
        self.layout, self.transport = layout, transport
        self.dataset, self.batch_sampler, self.collate_fn = dataset, batch_sampler, collate_fn
        self.iteration, self.queue_size = iteration, max(1, queue_size)
        self.collective_device = collective_device
        self.wait_seconds = 0.0  # this rank waited for rows
        self._clock = self._iteration_clock = time.perf_counter()
        self._bytes_at_clock = self._iteration_bytes = 0

    def __len__(self) -> int:
        return len(self.batch_sampler)

    # -- figures -------------------------------------------------------------------------------
    def _rate(self) -> float:
        """Bytes received per second since the last call."""
        now = time.perf_counter()
        moved = self.transport.bytes_moved - self._bytes_at_clock
        rate = moved / max(now - self._clock, 1e-9)
        self._clock, self._bytes_at_clock = now, self.transport.bytes_moved
        return rate

    def progress_fields(self) -> dict[str, str]:
        """Megabytes received per second over this iteration, and this rank's total wait."""
        seconds = max(time.perf_counter() - self._iteration_clock, 1e-9)
        rate = (self.transport.bytes_moved - self._iteration_bytes) / seconds / 1e6
        return {"recv_MB_s": f"{rate:,.1f}", "wait_s": f"{self.wait_seconds:.1f}"}

    def step_metrics(self) -> dict[str, float]:
        return {
            "online_bytes_per_second": self._rate(),
            "online_bytes": float(self.transport.bytes_moved),
            "online_wait_seconds": self.wait_seconds,
        }

    # -- rows ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[PackedBatch]:
        epoch, first = int(self.batch_sampler.epoch), int(self.batch_sampler.position)
        self._iteration_clock, self._iteration_bytes = (
            time.perf_counter(),
            self.transport.bytes_moved,
        )
        steps = [list(step) for step in self.batch_sampler]
        answers: queue.Queue = queue.Queue(maxsize=self.queue_size)
        stop = threading.Event()
        receiver = threading.Thread(
            target=self._receive,
            args=(epoch, first, len(steps), answers, stop),
            name="online-receiver",
            daemon=True,
        )
        receiver.start()
        try:
            for offset, step in enumerate(steps):
                started = time.perf_counter()
                answer: StepSamples = answers.get()
                self.wait_seconds += time.perf_counter() - started
                self._agree(answer, first + offset)
                yield self.collate_fn(
                    [self.dataset.item(item, answer.samples.get(item)) for item in step]
                )
        finally:
            stop.set()
            while receiver.is_alive():  # make room: the in-flight request gets its answer first
                try:
                    answers.get_nowait()
                except queue.Empty:
                    pass
                receiver.join(timeout=0.1)

    def _receive(
        self, epoch: int, first: int, count: int, answers: queue.Queue, stop: threading.Event
    ) -> None:
        for step in range(first, first + count):
            if stop.is_set():
                return
            source = self.layout.extraction_rank_of_step(step)
            try:
                self.transport.request(source, SampleRequest(REQUEST, self.iteration, epoch, step))
                answer = self.transport.receive_answer(source)
            except Exception as error:  # noqa: BLE001 - the process (or its link) is gone
                answer = StepSamples(
                    failure=(
                        f"extraction rank {source} stopped answering ({type_and_first_line(error)})"
                    )
                )
            while not stop.is_set():
                try:
                    answers.put(answer, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if answer.failure is not None:
                return

    def _agree(self, answer: StepSamples, step: int) -> None:
        """Every training rank has its row of `step`, or all raise (the same step everywhere)."""
        failed = torch.tensor([0 if answer.failure is None else 1], device=self.collective_device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if int(failed.item()) == 0:
            return
        messages: list[str | None] = (
            [None] * dist.get_world_size() if dist.is_initialized() else [None]
        )
        if len(messages) > 1:  # every rank says why: the extraction rank's own words
            dist.all_gather_object(messages, answer.failure)
        else:
            messages = [answer.failure]
        said = next((message for message in messages if message), None)
        raise ExtractionFailed(said or f"no samples for step {step + 1}")


def finish_extraction(layout: RankLayout, transport: Transport) -> None:
    """Tell every extraction rank this training rank is done (they return once all are)."""
    for rank in range(layout.extraction_ranks):
        try:
            transport.done(rank)
        except Exception:  # noqa: BLE001 - a rank that is gone needs no goodbye
            pass
