"""Rows packed by the loader's workers into reused host slots (#28): the same rows as the plain
loader's, a held row never overwritten, no wait that never ends when an iteration is abandoned.
The CUDA-only paths (pinning, its fallback, the copy recording): `test_row_slots_cuda.py`."""

from __future__ import annotations

import pickle
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.sample_io import write_sample
from speculators_vllm016.train.data import Eagle3SampleFileDataset, create_collate_fn
from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators_vllm016.train.loading.row_slots import (
    HOST_SLOT_KEY,
    HostRowSlots,
    SlotRow,
    slot_count,
)
from speculators_vllm016.train.loading.sample_loader import SampleFileLoader

HIDDEN = 4
MAX_LEN = 40
LENGTHS = [9, 13, 17, 21, 11, 15, 19, 7, 12, 16, 10, 14]
ROW_KEYS = (
    "input_ids",
    "hidden_states",
    "verifier_last_hidden_states",
    "loss_mask",
    "position_ids",
    "lengths",
    "sample_indices",
)


def write_distinct_files(folder: Path, lengths: list[int], ids_dtype=torch.long) -> None:
    """Every sample's states differ (its index and each token's position are in the values), so a
    row overwritten by another shows."""
    for index, length in enumerate(lengths):
        positions = torch.arange(length, dtype=torch.float32)[:, None]
        layers = [
            (index * 100 + positions + layer / 10).expand(length, HIDDEN).to(torch.bfloat16)
            for layer in range(4)
        ]
        write_sample(
            folder / f"data_{index}.pt",
            {
                "input_ids": torch.arange(index, index + length).to(ids_dtype),
                "hidden_states": layers,
                "loss_mask": (torch.arange(length) % 3 != 0).long(),
            },
        )


def make_loader(folder: Path, slots: int | None, workers: int = 2) -> SampleFileLoader:
    data = Eagle3SampleFileDataset(
        MAX_LEN, datapath=str(folder), seed=7, output_dtype=torch.bfloat16, device_noise=True
    )
    sampler = MultipackDistributedBatchSamplerV2(MAX_LEN, data.lengths, 1, 0, seed=3)
    row_slots = None
    if slots is not None:
        row_slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=workers * 2, count=slots)
    return SampleFileLoader(
        data,
        batch_sampler=sampler,
        collate_fn=create_collate_fn(MAX_LEN),
        num_workers=workers,
        prefetch_factor=2,
        persistent_workers=True,
        row_slots=row_slots,
    )


def snapshot(row: dict) -> dict[str, torch.Tensor]:
    return {key: row[key].clone() for key in ROW_KEYS if key in row}


def same(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(
        first[key].dtype == second[key].dtype and torch.equal(first[key], second[key])
        for key in first
    )


def held_like_the_trainer(rows, pause: float = 0.0):
    """Read rows as `prefetch_to_device` does (row n is still held when row n + 1 arrives) and
    check that row n is intact then; the snapshots, taken when each row arrived."""
    taken, held = [], None
    for row in rows:
        if held is not None:
            time.sleep(pause)  # give the workers time to write where they must not
            assert same(snapshot(held[0]), held[1]), "a held row was overwritten"
        held = (row, snapshot(row))
        taken.append(held[1])
    return taken


@contextmanager
def deadline(seconds: int):
    def expired(*_):
        raise TimeoutError(f"no row within {seconds} s: a worker waits for a slot never freed")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_slot_rows_equal_the_plain_rows_over_streamed_epochs_and_a_held_row_stays_intact(tmp_path):
    write_distinct_files(tmp_path, LENGTHS)
    plain, slotted = make_loader(tmp_path, None), make_loader(tmp_path, slots=3)
    assert slotted.row_slots is not None and slotted.row_slots.count == 3
    with deadline(120):
        for epoch in range(3):
            expected = [snapshot(row) for row in plain.epoch_rows(epoch, last_epoch=2)]
            got = held_like_the_trainer(slotted.epoch_rows(epoch, last_epoch=2), pause=0.05)
            assert len(got) == len(expected) >= 3
            assert all(same(a, b) for a, b in zip(got, expected, strict=True)), epoch


def test_slot_rows_carry_their_claim_and_come_from_the_slots(tmp_path):
    write_distinct_files(tmp_path, LENGTHS)
    loader = make_loader(tmp_path, slots=4)
    with deadline(60):
        row = next(iter(loader))
    buffers = loader.row_slots.buffers
    assert row[HOST_SLOT_KEY].row == 0
    for key in (
        "input_ids",
        "hidden_states",
        "verifier_last_hidden_states",
        "loss_mask",
        "position_ids",
    ):
        assert row[key].untyped_storage().data_ptr() == buffers[key].untyped_storage().data_ptr(), (
            key
        )


def test_a_worker_sends_the_slot_number_not_the_row(tmp_path):
    write_distinct_files(tmp_path, LENGTHS)
    data = Eagle3SampleFileDataset(
        MAX_LEN, datapath=str(tmp_path), output_dtype=torch.bfloat16, device_noise=True
    )
    slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=2, count=3)
    slots.released[0] = 3  # rows 0-3 released: row 5 may take slot 2
    with deadline(10):
        sent = slots.pack([data[0], data[1]], row=5)
    assert isinstance(sent, SlotRow) and sent.slot == 2 and not sent.shared
    assert set(sent.in_slot) == {
        "input_ids",
        "hidden_states",
        "verifier_last_hidden_states",
        "loss_mask",
        "position_ids",
    }
    assert len(pickle.dumps(sent)) < 2000  # what crosses the pipe: no row of states


def test_an_abandoned_iteration_frees_its_slots(tmp_path):
    """Two rows read, then the epoch asked for again (a fresh iteration): the workers' leftovers
    of the first iteration must not wait for slots the trainer will never release."""
    write_distinct_files(tmp_path, LENGTHS)
    plain, slotted = make_loader(tmp_path, None), make_loader(tmp_path, slots=3, workers=3)
    expected = [snapshot(row) for row in plain.epoch_rows(0, last_epoch=2)]
    with deadline(60):
        first = slotted.epoch_rows(0, last_epoch=2)
        next(first), next(first)
        time.sleep(0.5)  # the workers run ahead and wait for slots
        again = held_like_the_trainer(slotted.epoch_rows(0, last_epoch=2))
    assert all(same(a, b) for a, b in zip(again, expected, strict=True))


def test_rows_that_do_not_fit_the_slots_still_arrive_whole(tmp_path):
    """Slots made for fp32 states, rows of bf16: the states travel as shared tensors instead."""
    write_distinct_files(tmp_path, LENGTHS)
    plain, slotted = make_loader(tmp_path, None), make_loader(tmp_path, slots=3)
    for key in ("hidden_states", "verifier_last_hidden_states"):
        slotted.row_slots.buffers[key] = slotted.row_slots.buffers[key].float()
    with deadline(60):
        expected = [snapshot(row) for row in plain.epoch_rows(0)]
        got = held_like_the_trainer(slotted.epoch_rows(0))
    assert got[0]["hidden_states"].dtype == torch.bfloat16
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))


def test_no_slots_without_persistent_workers(tmp_path):
    write_distinct_files(tmp_path, LENGTHS[:4])
    data = Eagle3SampleFileDataset(MAX_LEN, datapath=str(tmp_path), device_noise=True)
    slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=2)
    sampler = MultipackDistributedBatchSamplerV2(MAX_LEN, data.lengths, 1, 0)
    for workers, persistent in ((0, False), (2, False)):
        loader = SampleFileLoader(
            data,
            batch_sampler=sampler,
            collate_fn=create_collate_fn(MAX_LEN),
            num_workers=workers,
            persistent_workers=persistent,
            row_slots=slots,
        )
        assert loader.row_slots is None


@pytest.mark.parametrize(
    ("row_bytes", "in_flight", "expected"),
    [
        (2**20, 48, 50),  # small rows: every row in flight has its slot
        (2**30, 48, 8),  # 1 GiB rows: the 8 GiB budget
        (3 * 2**30, 48, 8),  # never fewer than 8 (a step at long rows needs rows ahead)
        (2**20, 0, 3),  # never fewer than 3 (a consumer holds two)
    ],
)
def test_slot_count(row_bytes, in_flight, expected):
    assert slot_count(row_bytes, in_flight) == expected


def test_fewer_than_three_slots_are_refused():
    with pytest.raises(ValueError, match="at least 3"):
        HostRowSlots(2, MAX_LEN, {"input_ids": ((), torch.long)})


def test_closing_the_slots_frees_a_waiting_worker(tmp_path):
    import threading

    write_distinct_files(tmp_path, LENGTHS[:3])
    data = Eagle3SampleFileDataset(MAX_LEN, datapath=str(tmp_path), device_noise=True)
    slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=1, count=3)
    samples = [data[0]]
    waiting = threading.Thread(
        target=slots.pack, args=(samples, 4), daemon=True
    )  # needs row 1 freed
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive()  # row 1 was never released: it waits
    slots.close()
    waiting.join(timeout=30)
    assert not waiting.is_alive()
