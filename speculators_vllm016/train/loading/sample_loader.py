"""The trainer's offline loader: a `DataLoader` over `Eagle3SampleFileDataset` whose rows carry
their noise (`RowNoise`), whose one iteration can run across epoch boundaries, and whose workers
can pack rows into reused, pinned host slots (`row_slots`) (#28); plus the same noise for rows
collated in the main process (online extraction). The rows themselves are `train.data`'s
contract."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from torch.utils.data import DataLoader, default_collate

from speculators_vllm016.train.data import BatchType, Eagle3SampleFileDataset, PackedBatch
from speculators_vllm016.train.loading.loader_contract import (
    Closes,
    ReadsAcrossEpochs,
    TrainingLoader,
)
from speculators_vllm016.train.loading.row_slots import (
    HostRowSlots,
    SlotPackingDataset,
    packed_row_collate,
)
from speculators_vllm016.train.noise_transforms import RowNoise
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.stop_signals import ignore_stop_signals, stop_signals_held

__all__ = ["RunThroughBatchSampler", "SampleFileLoader", "main_process_noise"]


class RunThroughBatchSampler:
    """A batch sampler that can run on past its epoch: once `run` is set to (epoch, step, last
    epoch), one iteration yields the batches from that step through the end of the last epoch.

    One `DataLoader` iteration then spans several epochs, so its workers read the next epoch's
    first rows while this epoch's last steps run and its checkpoint is written, instead of
    starting from an empty prefetch window at every epoch boundary (#28). Everything else
    (`set_epoch`, `len`, `state_dict`, ...) is the wrapped sampler's; with `run` unset it iterates
    exactly as the wrapped sampler does.
    """

    def __init__(self, batch_sampler: Any, slots: HostRowSlots | None = None) -> None:
        self.batch_sampler = batch_sampler
        self.run: tuple[int, int, int] | None = None
        self.slots = slots  # when set, each batch is numbered for its row's slot

    def __getattr__(self, name: str) -> Any:
        if name in ("batch_sampler", "slots"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    @property
    def can_run_through(self) -> bool:
        """Whether the wrapped sampler can plan any epoch (`batches(epoch)`)."""
        return callable(getattr(self.batch_sampler, "batches", None))

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.batch_sampler) if self.run is None else self._run_batches(*self.run)
        if self.slots is None:
            return batches
        return map(self.slots.issue, batches)

    def _run_batches(self, epoch: int, step: int, last_epoch: int) -> Iterator[list[int]]:
        for current in range(epoch, last_epoch + 1):
            yield from self.batch_sampler.batches(current)[step if current == epoch else 0 :]


class SampleFileLoader(DataLoader, TrainingLoader, ReadsAcrossEpochs, Closes):
    """The trainer's offline loader: a `DataLoader` whose rows carry their `RowNoise`.

    The noise needs the epoch, which the main process knows (`set_epoch` reaches the dataset
    here, not a persistent worker's copy): each row gets the `RowNoise` of its epoch, under the
    key `row_noise`, when the dataset defers its noise.

    `epoch_rows` is how the trainer reads it: one iteration of the underlying `DataLoader` runs
    through the remaining epochs (`RunThroughBatchSampler`), and each call hands out one epoch's
    share of it. Iterating the loader (`iter`) still gives the current epoch alone.

    With `row_slots` (and workers) the workers pack each row into a reused host slot that the main
    process pins for the GPU (`row_slots`); the loader's own `pin_memory` is then off (nothing
    left for it to do). Rows read from a slot carry their `HostSlot` under `HOST_SLOT_KEY`.

    The workers ignore SIGTERM and Ctrl-C sent to the whole process group (`utils.stop_signals`):
    the trainer finishes its step and checkpoints; a worker killed by the signal would crash it.
    """

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        batch_sampler: Any = None,
        row_slots: HostRowSlots | None = None,
        **kwargs: Any,
    ) -> None:
        if row_slots is not None and not (
            kwargs.get("num_workers") and kwargs.get("persistent_workers")
        ):
            row_slots = None  # slots need workers that outlive an iteration (see `_start`)
        if batch_sampler is not None and not isinstance(batch_sampler, RunThroughBatchSampler):
            batch_sampler = RunThroughBatchSampler(batch_sampler)
        self.row_slots = row_slots
        self._pin_slots = False
        if row_slots is not None:
            if batch_sampler is None:
                raise InvalidInputError(
                    "row slots need a batch sampler (rows are numbered per batch)"
                )
            batch_sampler.slots = row_slots
            dataset = SlotPackingDataset(dataset, row_slots)
            kwargs["collate_fn"] = packed_row_collate(kwargs.get("collate_fn") or default_collate)
            self._pin_slots = bool(kwargs.pop("pin_memory", False))
        kwargs["worker_init_fn"] = partial(_init_worker, kwargs.get("worker_init_fn"))
        super().__init__(dataset, *args, batch_sampler=batch_sampler, **kwargs)
        self._stream: Iterator[Any] | None = None
        self._stream_next: tuple[int, int, int] | None = None  # (epoch, step, last epoch)

    def __del__(self) -> None:
        if getattr(self, "row_slots", None) is not None:
            self.row_slots.close()  # before the workers are joined: none may wait for a slot

    def close(self) -> None:
        """End the worker processes now. They ignore SIGTERM, so the interpreter's exit (which
        terminates and then joins them) would wait for ever on one still running: the job closes
        its loaders when it ends, however it ends. A worker that does not leave when asked is
        killed."""
        iterator, self._stream = getattr(self, "_iterator", None), None
        if iterator is None:
            return
        workers = list(getattr(iterator, "_workers", []))
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        self._iterator = None
        if self.row_slots is not None:
            self.row_slots.close()

    def _start(self) -> Iterator[Any]:
        """A new iteration of the underlying `DataLoader` (the slots of the last one freed first)."""
        if self.row_slots is not None:
            self.row_slots.reset()
        with stop_signals_held():  # the workers start here (once, as they persist)
            rows = super().__iter__()
        if self.row_slots is None:
            return rows
        return map(partial(self.row_slots.take, pin=self._pin_slots), rows)

    def __iter__(self) -> Any:
        self._stream, self._stream_next = None, None  # a fresh iteration ends a running one
        rows = self._start()  # now: the worker seeds are drawn where the trainer expects
        noise = self.dataset.row_noise() if hasattr(self.dataset, "row_noise") else None
        if noise is None:
            return rows
        return _with_noise(rows, noise)

    def _epoch_free_workers(self) -> bool:
        """Whether the workers' rows are the same whatever the epoch (noise deferred or none):
        only then may one iteration run on into the next epoch."""
        dataset = self.dataset
        return getattr(dataset, "transform", None) is None or bool(
            getattr(dataset, "device_noise", False)
        )

    def epoch_rows(
        self, epoch: int, start_step: int = 0, *, last_epoch: int | None = None
    ) -> Iterator[Any]:
        """The rows of `epoch` from `start_step` (what `set_epoch` and `iter` give), read ahead
        into the epochs up to `last_epoch`: the next call, for the next epoch, continues the same
        iteration. The iteration starts (and the workers' seeds are drawn) here, not lazily."""
        sampler = self.batch_sampler
        sampler.set_epoch(epoch, start_step)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        streams = isinstance(sampler, RunThroughBatchSampler) and sampler.can_run_through
        if not streams:
            return iter(self)
        last = (
            epoch
            if last_epoch is None or not self._epoch_free_workers()
            else max(epoch, last_epoch)
        )
        count = len(sampler) - start_step
        noise = self.dataset.row_noise() if hasattr(self.dataset, "row_noise") else None
        if self._stream is None or self._stream_next != (epoch, start_step, last):
            sampler.run = (epoch, start_step, last)
            try:
                stream = self._start()
            finally:
                sampler.run = None
            self._stream = stream
        self._stream_next = None  # until this epoch's rows are all taken
        after = (epoch + 1, 0, last) if epoch < last else None
        return self._take(self._stream, count, noise, after)

    def _take(
        self,
        stream: Iterator[Any],
        count: int,
        noise: RowNoise | None,
        after: tuple[int, int, int] | None,
    ) -> Iterator[Any]:
        for taken in range(count):
            try:
                row = next(stream)
            except StopIteration:
                raise RuntimeError(
                    f"the loader's iteration ended after {taken} of this epoch's {count} rows"
                ) from None
            if noise is not None and "sample_indices" in row:
                row["row_noise"] = noise
            yield row
        if stream is self._stream:
            self._stream_next = after


def _init_worker(then: Callable[[int], Any] | None, worker_id: int) -> None:
    """A loader worker's start: stop signals ignored, then the caller's own `worker_init_fn`."""
    ignore_stop_signals()
    if then is not None:
        then(worker_id)


def _with_noise(rows: Any, noise: RowNoise) -> Any:
    for row in rows:
        if "sample_indices" in row:
            row["row_noise"] = noise
        yield row


def main_process_noise(
    collate: Callable[[list[BatchType | None]], PackedBatch], dataset: Eagle3SampleFileDataset
) -> Callable[[list[BatchType | None]], PackedBatch]:
    """`collate` whose rows carry `dataset`'s `RowNoise` as of each call: for a loader that
    collates in the main process (online extraction), where the dataset's epoch is current."""

    def run(samples: list[BatchType | None]) -> PackedBatch:
        row = collate(samples)
        noise = dataset.row_noise()
        if noise is not None and "sample_indices" in row:
            row["row_noise"] = noise  # type: ignore[typeddict-unknown-key]
        return row

    return run
