"""The row slots' CUDA-only paths on a real GPU (#37): the buffers pinned once with
`cudaHostRegister` (and unregistered with them), a failed pinning tried once and harmless to the
CUDA work after it, and a slot written again only after its row's asynchronous copy to the GPU
has run.

Marked `cuda` (`pytest -m cuda` on a GPU machine); skipped where no CUDA device is (CI)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from speculators_vllm016.train.data import Eagle3SampleFileDataset
from speculators_vllm016.train.loading.row_slots import HOST_SLOT_KEY, HostRowSlots
from tests.train.loading.test_row_slots import (
    LENGTHS,
    MAX_LEN,
    deadline,
    make_loader,
    snapshot,
    write_distinct_files,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# About 50 ms of GPU time at the H200's clock: long enough that a copy queued behind a few of them
# is still waiting when the loader, on the host, hands out the rows after it.
SLEEP_CYCLES = 100_000_000


class CountingRuntime:
    """`torch.cuda.cudart()` that counts the `cudaHostRegister` calls (every call is made)."""

    def __init__(self) -> None:
        self.runtime = torch.cuda.cudart()
        self.registrations = 0

    def cudaHostRegister(self, *args: Any) -> Any:  # noqa: N802 - the runtime's name
        self.registrations += 1
        return self.runtime.cudaHostRegister(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


@pytest.fixture
def counting_runtime(monkeypatch) -> CountingRuntime:
    runtime = CountingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    return runtime


def unregister(buffers) -> None:
    runtime = torch.cuda.cudart()
    for buffer in buffers:
        runtime.cudaHostUnregister(buffer.data_ptr())


def test_the_slots_are_pinned_once_and_rows_copy_from_them(tmp_path, counting_runtime):
    write_distinct_files(tmp_path, LENGTHS)
    plain, slotted = make_loader(tmp_path, None), make_loader(tmp_path, slots=3)
    slotted._pin_slots = True
    from speculators_vllm016.train.loading.device_rows import prefetch_to_device

    device = torch.device("cuda")
    with deadline(120):
        for epoch in range(2):
            expected = [snapshot(row) for row in plain.epoch_rows(epoch, last_epoch=1)]
            got = [
                {key: value.cpu() for key, value in row.inputs.items()}
                for row in prefetch_to_device(slotted.epoch_rows(epoch, last_epoch=1), device, None)
            ]
            assert len(got) == len(expected) >= 3
            for a, b in zip(got, expected, strict=True):
                assert all(torch.equal(a[key], b[key]) for key in a), epoch
    buffers = slotted.row_slots.buffers
    assert slotted.row_slots._pinned
    assert all(buffer.is_pinned() for buffer in buffers.values())
    assert counting_runtime.registrations == len(buffers)  # once per buffer, not per row or epoch


def _slots_with_rows(folder, rows: int) -> tuple[HostRowSlots, list]:
    """Slots of a dataset and `rows` rows packed into them in this process, one sample a row."""
    write_distinct_files(folder, LENGTHS)
    data = Eagle3SampleFileDataset(
        MAX_LEN, datapath=str(folder), output_dtype=torch.bfloat16, device_noise=True
    )
    slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=1, count=8)
    return slots, [slots.pack([data[index]], row=index) for index in range(rows)]


def test_a_failed_pinning_is_tried_once_and_the_gpu_work_after_it_runs(
    tmp_path, caplog, counting_runtime
):
    slots, sent = _slots_with_rows(tmp_path, 4)
    taken = list(slots.buffers.values())[-1]
    # Registered already: the slots' own registration of it fails.
    size = taken.numel() * taken.element_size()
    assert int(torch.cuda.cudart().cudaHostRegister(taken.data_ptr(), size, 0)) == 0
    try:
        with caplog.at_level(logging.WARNING, logger="speculators_vllm016.train.loading.row_slots"):
            rows = [slots.take(sent[0], pin=True)]
            tried = counting_runtime.registrations
            rows += [slots.take(one, pin=True) for one in sent[1:]]
        # The failure is not left for the next kernel launch to report as its own.
        doubled = torch.arange(4, device="cuda") * 2
        assert doubled.tolist() == [0, 2, 4, 6]
        assert not slots._pinned
        assert tried > 1 and counting_runtime.registrations == tried  # tried at the first row only
        warnings = [r for r in caplog.records if "could not pin" in r.getMessage()]
        assert len(warnings) == 1
        # all or nothing: the buffers registered before the failure are released again
        assert not any(
            buffer.is_pinned() for buffer in slots.buffers.values() if buffer is not taken
        )
        for row, one in zip(rows, sent, strict=True):
            on_gpu = row["hidden_states"].to("cuda", non_blocking=True)
            assert torch.equal(on_gpu.cpu(), slots.buffers["hidden_states"][one.slot][None])
    finally:
        unregister([taken])


def test_slots_made_after_others_were_dropped_are_pinned_too(tmp_path):
    """Pinned memory is unregistered with its slots: the driver would otherwise keep the
    registration of the freed addresses, and the next slots mapped there would not pin."""
    write_distinct_files(tmp_path, LENGTHS)
    data = Eagle3SampleFileDataset(
        MAX_LEN, datapath=str(tmp_path), output_dtype=torch.bfloat16, device_noise=True
    )
    for _ in range(3):
        slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=1, count=8)
        assert slots.pin(), "slots mapped where earlier ones were could not be pinned"
        del slots
        gc.collect()


def test_a_slot_is_written_again_only_after_its_copy_to_the_gpu_ran(tmp_path):
    """The GPU runs behind the host (a sleep on the training stream after every row, as a long
    step would): each row's copy waits there while the loader hands out the next rows. Released
    before its copy ran, a slot would be packed again and the GPU would get another row."""
    from speculators_vllm016.train.loading.device_rows import prefetch_to_device

    write_distinct_files(tmp_path, LENGTHS)
    plain, slotted = make_loader(tmp_path, None), make_loader(tmp_path, slots=3)
    slotted._pin_slots = True
    device = torch.device("cuda")
    claims, got, expected = [], [], []
    with deadline(120):
        for epoch in range(3):
            expected += [snapshot(row) for row in plain.epoch_rows(epoch, last_epoch=2)]
            rows = slotted.epoch_rows(epoch, last_epoch=2)
            for row in prefetch_to_device(_keeping_claims(rows, claims), device, None):
                got.append(row.inputs)  # on the GPU, read only once all the work has run
                torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()
    assert slotted.row_slots._pinned  # unpinned memory would make the copies wait on the host
    assert len(got) == len(expected) >= 9
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert all(torch.equal(a[key].cpu(), b[key]) for key in a), f"row {index} was overwritten"
    assert all(isinstance(claim.copied, torch.cuda.Event) for claim in claims)


def _keeping_claims(rows, claims: list):
    for row in rows:
        claims.append(row[HOST_SLOT_KEY])
        yield row
