"""Packed rows handed from loader workers to the main process through a fixed ring of host
buffers, pinned for the copy to the GPU (#28).

Without them every row a worker packs lands in fresh shared memory: the worker faults in (and the
kernel zeroes) its pages, the main process maps them, the pin-memory thread copies the row once
more into pinned memory, and the mapping is torn down again. At 1 GiB a row (32,768 tokens at
hidden 4096) that kernel work ran beside every step and slowed the GPU steps themselves by 10-25%
while the workers read ahead (docs/benchmarks.md, folded results: trainer-sustained-*-before-row-slots).

Here the rows live in `count` slots allocated once in shared memory, which the main process pins
(`cudaHostRegister`) after the workers have started: a worker packs row n straight into slot
n % count and sends only a `SlotRow` (the slot and the row's small tensors); the main process
reads the row in place, and the copy to the GPU starts from it.

The hand-over rule: row n's slot is written again (by row n + count) only once row n is released.
The loader releases row n when it hands out row n + 2 (a consumer holds at most two rows: one
training, one being copied), after waiting for the row's copy to the device when one was recorded
(`HostSlot.record_copy`, done by `device_rows`). A worker whose slot is not free yet waits; with
count >= 3 the row the main process waits for never does. A new iteration releases every row
handed out or issued before it (`reset`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from speculators_vllm016.train.data import (
    BatchType,
    PackedBatch,
    new_row_buffer,
    pack_samples,
    shared_empty,
)
from speculators_vllm016.train.stored_states import fp8_row_layers
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "HOST_SLOT_KEY",
    "HostRowSlots",
    "HostSlot",
    "SlotIndices",
    "SlotPackingDataset",
    "SlotRow",
    "VALIDATION_ROW_SLOTS",
    "slot_count",
]

logger = logging.getLogger(__name__)

HOST_SLOT_KEY = "host_slot"
"""The key under which a row read from a slot carries its `HostSlot` (the main process only)."""

DEFAULT_BUDGET_BYTES = 8 * 2**30
MIN_SLOTS = 3
VALIDATION_ROW_SLOTS = 4  # validation runs a few rows once an epoch: no reason to hold more
_INLINE_NUMEL = 1 << 16
_NOT_NUMPY = (torch.bfloat16, torch.float8_e4m3fn)  # travel as shared tensors, never inline
_NEVER_WAIT = 1 << 62  # small tensors travel inside the pickled `SlotRow`, not as shared memory


def slot_count(
    row_bytes: int, rows_in_flight: int, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> int:
    """How many slots: the loader's rows in flight plus the two a consumer holds, but no more
    than `budget_bytes` of host memory allow, and never fewer than 8 (nor than `MIN_SLOTS`):
    fewer rows ahead than that starve a step at long rows."""
    wanted = rows_in_flight + 2
    affordable = max(8, budget_bytes // max(row_bytes, 1))
    return max(MIN_SLOTS, min(wanted, affordable))


class SlotIndices(list):
    """One row's sample indices and the row's number in the loader's run (its slot is
    `row % count`): what the batch sampler hands to the workers when the rows use slots."""

    def __init__(self, indices: Sequence[int], row: int) -> None:
        super().__init__(indices)
        self.row = int(row)

    def __reduce__(self) -> Any:
        return SlotIndices, (list(self), self.row)


@dataclass
class SlotRow:
    """What a worker sends for a packed row: its number, its slot, the keys written there, and
    the row's other tensors: small ones inline (numpy, pickled with this object), any other (a
    tensor whose shape or dtype the slot does not have) as a shared tensor."""

    row: int
    slot: int
    in_slot: tuple[str, ...]
    inline: dict[str, np.ndarray] = field(default_factory=dict)
    shared: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HostSlot:
    """A row's claim on its slot, in the main process: the row's tensors are read from the slot
    until the loader releases it; `record_copy` marks the copy to the device, which the release
    waits for."""

    row: int
    copied: Any = None  # torch.cuda.Event once the row's copy to a GPU was issued

    def record_copy(self) -> None:
        """Record (on the current CUDA stream) that the row's copy to the GPU has been issued."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()
            self.copied = event

    def wait_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


class HostRowSlots:
    """`count` packed-row buffers in shared memory, one tensor per slotted key
    (`[count, max_len, *width]`), and the count of released rows the workers wait on.

    Made in the main process before the workers start (they inherit or receive the buffers); the
    main process numbers the rows (`issue`), reads them (`take`) and releases them (see the
    module docstring); the workers pack into them (`pack`).
    """

    def __init__(
        self, count: int, max_len: int, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> None:
        if count < MIN_SLOTS:
            raise InvalidInputError(f"at least {MIN_SLOTS} row slots are needed, got {count}")
        self.count = int(count)
        self.max_len = int(max_len)
        self.buffers = {
            key: shared_empty((self.count, self.max_len, *width), dtype)
            for key, (width, dtype) in layout.items()
        }
        self.released = shared_empty((1,), torch.long).fill_(-1)  # rows 0..released are free
        self._issued = 0
        self._handed: deque[HostSlot] = deque()
        self._pinned = False
        self._pin_failed = False
        self._main_pid = os.getpid()

    @classmethod
    def for_dataset(
        cls,
        dataset: Any,
        max_len: int,
        rows_in_flight: int,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        count: int | None = None,
    ) -> HostRowSlots | None:
        """Slots for an `Eagle3SampleFileDataset`'s packed rows (its widths, the dtype its rows
        store the states in), `count` of them or as `slot_count` says; None when its widths are
        unknown."""
        widths = getattr(dataset, "widths", None)
        if widths is None:
            return None
        states = getattr(dataset, "output_dtype", None) or dataset.hidden_states_dtype
        stored = states
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        layers = fp8_row_layers(dataset)
        if layers is not None:  # fp8 states and their scales (one per layer) travel to the device
            stored = torch.float8_e4m3fn
            layout["hidden_states_scale"] = ((layers[0],), states)
            layout["verifier_last_hidden_states_scale"] = ((layers[1],), states)
        layout.update(
            {
                "input_ids": ((), torch.long),
                "hidden_states": ((int(widths[0]),), stored),
                "verifier_last_hidden_states": ((int(widths[1]),), stored),
                "loss_mask": ((), torch.long),
                "position_ids": ((), torch.long),
            }
        )
        per_token = sum(
            (width[0] if width else 1) * dtype.itemsize for width, dtype in layout.values()
        )
        if count is None:
            count = slot_count(per_token * max_len, rows_in_flight, budget_bytes)
        return cls(count, max_len, layout)

    # -- main process ----------------------------------------------------------------------------
    def issue(self, indices: Sequence[int]) -> SlotIndices:
        """Number the next row of the loader's run."""
        tagged = SlotIndices(indices, self._issued)
        self._issued += 1
        return tagged

    def pin(self) -> bool:
        """Page-lock the buffers for asynchronous copies to the GPU (once, after the workers
        started: the driver keeps registered memory out of forked children). False when no GPU."""
        if self._pinned or self._pin_failed:
            return self._pinned
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        registered: list[torch.Tensor] = []
        for buffer in self.buffers.values():
            code = int(
                cudart.cudaHostRegister(
                    buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0
                )
            )
            if code != 0:
                for done in registered:  # all or nothing: no buffer is left pinned
                    cudart.cudaHostUnregister(done.data_ptr())
                _clear_cuda_error()
                self._pin_failed = True  # tried once: no retry (and no warning) per row
                logger.warning(
                    "could not pin the loader's row buffers (CUDA error %s); "
                    "copies to the GPU will not overlap the steps",
                    code,
                )
                return False
            registered.append(buffer)
        self._pinned = True
        return True

    def unpin(self) -> None:
        """Unregister the pinned buffers, once the copies from them have run. The driver keeps a
        registration past the memory's unmapping: memory mapped later at the same addresses (the
        next loader's slots in a long-lived process) could not be pinned again."""
        if not self._pinned or os.getpid() != self._main_pid:
            return
        while self._handed:
            self._handed.popleft().wait_copied()
        cudart = torch.cuda.cudart()
        for buffer in self.buffers.values():
            cudart.cudaHostUnregister(buffer.data_ptr())
        self._pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            self.unpin()

    def take(self, sent: SlotRow | Any, pin: bool) -> Any:
        """The row a worker sent, as the trainer reads it (a `PackedBatch` whose large tensors
        are views of the slot), carrying its `HostSlot`; releases rows two behind it. Anything
        that is not a `SlotRow` (a row the workers packed elsewhere) passes through unchanged."""
        if not isinstance(sent, SlotRow):
            return sent
        if pin:
            self.pin()
        row: dict[str, Any] = {key: self.buffers[key][sent.slot][None] for key in sent.in_slot}
        row.update({key: torch.from_numpy(value) for key, value in sent.inline.items()})
        for key, value in sent.shared.items():
            row[key] = value.pin_memory() if pin and torch.cuda.is_available() else value
        claim = HostSlot(sent.row)
        row[HOST_SLOT_KEY] = claim
        self._handed.append(claim)
        self._release_through(sent.row - 2)
        return row

    def _release_through(self, row: int) -> None:
        released = int(self.released[0])
        while self._handed and self._handed[0].row <= row:
            claim = self._handed.popleft()
            claim.wait_copied()
            released = max(released, claim.row)
        if released > int(self.released[0]):
            self.released[0] = released

    def reset(self) -> None:
        """Before a new iteration: every row handed out or issued so far is free (their copies
        finished first), so that the workers' leftovers of the last iteration never wait."""
        while self._handed:
            self._handed.popleft().wait_copied()
        self.released[0] = self._issued - 1

    def close(self) -> None:
        """Free every slot for good (the loader is going away): a worker waiting for one goes on,
        finishes its row and sees the loader's shutdown, instead of being killed after a
        time-out."""
        self.released[0] = _NEVER_WAIT

    # -- worker ----------------------------------------------------------------------------------
    def pack(self, samples: list[BatchType | None], row: int) -> SlotRow | PackedBatch:
        """Pack `samples` (as `pack_samples`) into row `row`'s slot, once that slot is free."""
        slot = row % self.count
        self._wait_free(row)
        written: list[str] = []

        def buffer(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            target = self.buffers.get(key)
            if (
                target is not None
                and tuple(target.shape[1:]) == tuple(shape)
                and target.dtype == dtype
            ):
                written.append(key)
                return target[slot]
            return new_row_buffer(key, shape, dtype)

        packed = pack_samples(samples, self.max_len, buffer)
        if "input_ids" not in packed:  # every sample unusable: nothing in the slot
            return packed
        sent = SlotRow(row=row, slot=slot, in_slot=tuple(written))
        for key, value in packed.items():
            if key in written:
                continue
            if value.numel() <= _INLINE_NUMEL and value.dtype not in _NOT_NUMPY:
                sent.inline[key] = value.numpy()
            else:
                sent.shared[key] = value
        return sent

    def _wait_free(self, row: int) -> None:
        """Wait until the row that last used this slot (row - count) is released."""
        previous = row - self.count
        pause = 0.0002
        while int(self.released[0]) < previous:
            if os.getppid() != self._main_pid and os.getpid() != self._main_pid:
                raise RuntimeError("the training process is gone; this loader worker stops")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)


def _clear_cuda_error() -> None:
    """Take a failed runtime call's error off this thread's CUDA "last error".

    The runtime keeps it until someone reads it, and torch reads it after its next kernel launch,
    which would then fail with the pinning's error as its own. A one-element fill is such a
    launch: its check reads (and so clears) the error; nothing else fails there.
    """
    try:
        torch.ones(1, device="cuda")
    except RuntimeError:
        pass


class SlotPackingDataset(torch.utils.data.Dataset):
    """`dataset` whose batches (a `SlotIndices` each) come out packed into their row's slot:
    `__getitems__` reads the samples and packs them there, in the worker. Every other attribute
    is the wrapped dataset's."""

    def __init__(self, dataset: Any, slots: HostRowSlots) -> None:
        self.dataset = dataset
        self.slots = slots

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "slots"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        samples = [self.dataset[index] for index in indices]
        if not isinstance(indices, SlotIndices):
            return samples
        return [self.slots.pack(samples, indices.row)]


def packed_row_collate(collate: Any) -> Any:
    """`collate` for a loader over a `SlotPackingDataset`: a row already packed into its slot
    passes through; a plain list of samples (no slot) is collated by `collate`."""

    def run(items: list[Any]) -> Any:
        if len(items) == 1 and (isinstance(items[0], SlotRow) or _is_row(items[0])):
            return items[0]
        return collate(items)

    return run


def _is_row(item: Any) -> bool:
    """A packed row whose samples were all unusable (`{"skipped_samples": n}` alone)."""
    return isinstance(item, dict) and set(item) == {"skipped_samples"}
