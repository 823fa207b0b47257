"""Checkpoints written while training goes on: a snapshot in the step loop, the files in a thread.

A Kimi-K2.5 draft's checkpoint is 18 GB (bf16 served weights, fp32 master weights, fp32 Adam
moments); written in the step loop it stopped training for 23-40 s on an H200. The loop now only
takes a snapshot of what changes in place (weights and optimizer moments) and hands the rest to
one writer thread:

- `stage` copies every live tensor. On a GPU, where the device has room for it outside the
  allocator's pool (the next steps' activations need that pool), the copy is a device-to-device
  clone, milliseconds for gigabytes, and the writer brings it to the host on a stream of its own
  while the next steps run, through two page-locked buffers (a plain copy to pageable memory
  held the training thread's next CUDA calls until it was done: the next epoch's first step
  took 9-13 s instead of 0.28 on an H100); without the room it is a synchronous copy to the host (what the
  step loop used to wait for before writing). On the CPU it is a clone.
- `CheckpointWriter` runs one write at a time; a second save waits for the first (its error, a
  full disk say, is raised there, after the next step, or when the run ends).

The crash guarantees are the checkpointer's and unchanged: the writer assembles the folder under
a hidden temporary name and renames it into place when every file is flushed, so a process killed
at any moment of a background write leaves the previous checkpoint whole and the next start
sweeps the temporary folder.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "DEVICE_HEADROOM_BYTES",
    "HOST_CHUNK_BYTES",
    "CheckpointWriter",
    "Staged",
    "copy_through",
    "stage",
    "to_host",
]

DEVICE_HEADROOM_BYTES = 2 * 2**30
"""Free device memory (outside the allocator's pool) a device snapshot leaves untouched."""

logger = logging.getLogger(__name__)

HOST_CHUNK_BYTES = 64 * 2**20
"""Size of each of the two page-locked buffers a device snapshot comes to the host through."""


@dataclass
class Staged:
    """Copies of a checkpoint's tensors that the step loop no longer touches.

    `tree` holds CPU tensors, or device clones (`on_device`) that `to_host` brings over once
    `ready` (an event recorded after the clones on the loop's stream) has passed.
    """

    tree: Any
    on_device: bool = False
    ready: torch.cuda.Event | None = None
    nbytes: int = 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


_RELEASED_SNAPSHOT_BYTES: dict[torch.device, int] = {}
"""Bytes of device snapshots freed (into the allocator's pool) since the last one was taken."""


def _room_on_device(device: torch.device, nbytes: int) -> bool:
    """Whether `nbytes` more fit on `device` without taking what the training steps'
    activations come back to in the allocator's cached pool.

    The pool's cached-but-unused memory that an earlier snapshot left when it was freed counts
    first: that snapshot lived beside the steps' activations, so the pool grew to hold both,
    and the next snapshot (the same tensors) fits where it was, leaving the device as it was
    then. Only what does not fit there must come from free memory, and leave
    `DEVICE_HEADROOM_BYTES` of it. Counting free memory alone, the second save at 32,768 tokens
    on an H100 fell back to the synchronous copy (12.25 s), and so did a rule that asked for the
    headroom on top of the reused part (5.0-6.2 s, the pool holding ~77 of 79 GiB). Where the
    pool cannot place the tensors after all (fragments), `stage` falls back on the allocator's
    out-of-memory error.
    """
    free, unused, released = _device_memory(device)
    reusable = max(0, min(unused, released))
    from_outside = nbytes - reusable
    return from_outside <= 0 or from_outside + DEVICE_HEADROOM_BYTES <= free


def _retake_released(device: torch.device, nbytes: int) -> None:
    """Count `nbytes` of the freed snapshots' pool memory as taken again by a new snapshot.

    A save stages two trees, the weights and then the optimizer state, and both were freed by
    the save before: the weights' snapshot takes back only its own part, and the optimizer's
    still finds the rest. (Reset to zero by the weights' snapshot, the optimizer state's 9.1 GB
    found no room at the second save at 32,768 tokens on an H100: the loop waited 4.89 s.)
    """
    _RELEASED_SNAPSHOT_BYTES[device] = max(0, _RELEASED_SNAPSHOT_BYTES.get(device, 0) - nbytes)


def _device_memory(device: torch.device) -> tuple[int, int, int]:
    """What `_room_on_device` decides on, in bytes: free memory outside the allocator's pool,
    the pool's unused part, and how much of that the freed snapshots left."""
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free, unused, _RELEASED_SNAPSHOT_BYTES.get(device, 0)


def _device_memory_summary(device: torch.device) -> str:
    """`_device_memory` for the fallback's warning: which figure fell short is what a fix
    needs to know."""
    free, unused, released = _device_memory(device)
    return (
        f"{free / 1e9:.1f} GB free outside the allocator's pool, {unused / 1e9:.1f} GB unused "
        f"in it, {released / 1e9:.1f} GB released by the last snapshot"
    )


def stage(tree: Any, *, live: bool = True, background: bool = True) -> Staged:
    """A copy of `tree`'s containers and tensors that later steps cannot change (see module).

    `live=False`: the tensors are already copies nobody else holds (a gathered full state);
    only the containers are copied. `background=False` (the files are written before the step
    loop goes on, `CheckpointWriter(background=False)`): nothing changes the tensors meanwhile,
    so host tensors are not copied and device ones come to the host directly, never cloned on
    the device: no memory beyond what writing needs.
    """
    tensors = _tensors(tree)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not live:  # new containers, the same tensors
        return Staged(tree=pytree.tree_map(lambda value: value, tree), nbytes=nbytes)
    cuda = [tensor for tensor in tensors if tensor.is_cuda]
    on_device = background and bool(cuda) and _room_on_device(cuda[0].device, nbytes)

    def copy_of(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        value = value.detach()
        if value.is_cuda and not on_device:
            return value.to("cpu")  # waits for the device: the fallback
        return value.clone() if background else value

    staged = None
    why = "the room rule"
    if on_device:
        try:
            staged = pytree.tree_map(copy_of, tree)
            _retake_released(cuda[0].device, nbytes)
        except torch.cuda.OutOfMemoryError:  # the pool could not place it after all
            on_device = False
            why = "the allocator's out-of-memory error"
    if background and cuda and not on_device:
        logger.warning(
            "checkpoint: no room on %s for a %.1f GB snapshot (%s; %s); copying it to the "
            "host while the step loop waits",
            cuda[0].device,
            nbytes / 1e9,
            why,
            _device_memory_summary(cuda[0].device),
        )
    if staged is None:
        staged = pytree.tree_map(copy_of, tree)
    ready = None
    if on_device:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(cuda[0].device))
    return Staged(tree=staged, on_device=on_device, ready=ready, nbytes=nbytes)


def copy_through(
    source: torch.Tensor,
    buffers: Sequence[torch.Tensor],
    after_copy: Callable[[], Callable[[], None]],
) -> torch.Tensor:
    """A new CPU tensor equal to `source`, copied a buffer's worth at a time: each chunk goes
    into one of two `buffers` (uint8, page-locked on a GPU), then from there into the result,
    the next chunk's copy running while the last one is read out.

    `after_copy()` is called after each chunk's copy is issued and returns a wait for that
    copy (on a GPU an event's `synchronize`). Every call the writer thread makes to the driver
    is then an asynchronous copy or a wait: a pageable copy (`tensor.to("cpu")`) instead held
    up the training thread's own calls (launches, row copies) until all 18 GB had come over.
    """
    result = torch.empty(source.shape, dtype=source.dtype)
    if source.numel() == 0:
        return result
    source_bytes = source.contiguous().reshape(-1).view(torch.uint8)
    result_bytes = result.reshape(-1).view(torch.uint8)
    size, chunk = source_bytes.numel(), buffers[0].numel()
    pending: tuple[torch.Tensor, int, int, Callable[[], None]] | None = None
    for index, start in enumerate(range(0, size, chunk)):
        end = min(size, start + chunk)
        buffer = buffers[index % 2][: end - start]
        buffer.copy_(source_bytes[start:end], non_blocking=True)
        copied = after_copy()
        if pending is not None:  # the chunk before: its buffer is taken again next round
            earlier, earlier_start, earlier_end, earlier_copied = pending
            earlier_copied()
            result_bytes[earlier_start:earlier_end].copy_(earlier)
        pending = (buffer, start, end, copied)
    if pending is not None:
        earlier, earlier_start, earlier_end, earlier_copied = pending
        earlier_copied()
        result_bytes[earlier_start:earlier_end].copy_(earlier)
    return result


def to_host(staged: Staged) -> Any:
    """`staged.tree` with every tensor on the CPU. Called in the writer thread: device clones
    copy over on a stream of their own, beside the training steps, through two page-locked
    buffers (`copy_through`), and are then freed."""
    if not staged.on_device:
        return staged.tree
    assert staged.ready is not None
    device = _tensors(staged.tree)[0].device
    stream = torch.cuda.Stream(device)
    stream.wait_event(staged.ready)
    buffers = [torch.empty(HOST_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def after_copy() -> Callable[[], None]:
        event = torch.cuda.Event()
        event.record(stream)
        return event.synchronize

    with torch.cuda.stream(stream):
        host = pytree.tree_map(
            lambda value: (
                copy_through(value, buffers, after_copy)
                if isinstance(value, torch.Tensor)
                else value
            ),
            staged.tree,
        )
    stream.synchronize()  # every copy has read its clone: the clones can go
    staged.tree = None
    _RELEASED_SNAPSHOT_BYTES[device] = _RELEASED_SNAPSHOT_BYTES.get(device, 0) + staged.nbytes
    return host


class CheckpointWriter:
    """Runs checkpoint writes one at a time in a background thread (or inline when not
    `background`).

    `start(name, job)` first waits for the write before it and re-raises that write's error;
    `wait()` waits for the current one; `raise_failure()` re-raises a finished write's error
    without waiting. A failed write's error is raised once.
    """

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, name: str, job: Callable[[], None]) -> float:
        """Run `job` (writes checkpoint `name`); returns the seconds waited for the write before."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        if not self.background:
            job()
            return waited

        def run() -> None:
            try:
                job()
            except BaseException as error:  # noqa: BLE001 (raised in the loop by wait/raise_failure)
                self._error = error

        self._thread = threading.Thread(target=run, name=f"checkpoint-{name}", daemon=True)
        self._thread.start()
        return waited

    def wait(self) -> None:
        """Block until the current write is done; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the error of a write that has finished and failed (without waiting)."""
        if self._error is not None and not self.busy:
            error, self._error = self._error, None
            raise error
