"""One loader iteration across epoch boundaries (#28): the workers read the next epoch's rows
while this epoch ends, and the rows are those of the per-epoch iteration, noise included."""

from __future__ import annotations

import torch

from speculators_vllm016.train.data import create_collate_fn
from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators_vllm016.train.loading.device_rows import to_step_row
from speculators_vllm016.train.loading.sample_loader import RunThroughBatchSampler, SampleFileLoader
from tests.train.test_device_noise import CPU, dataset, noised_rows, write_files

LENGTHS = [9, 13, 17, 21, 11, 15, 19, 7, 12, 16]


class RecordingSampler(MultipackDistributedBatchSamplerV2):
    """Records which epochs' plans were asked for (the loader asks as it dispatches rows)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.planned: list[int] = []

    def batches(self, epoch=None):
        self.planned.append(self.epoch if epoch is None else int(epoch))
        return super().batches(epoch)


def stream_loader(folder, workers: int, sampler_class=MultipackDistributedBatchSamplerV2):
    data = dataset(folder, 40)  # noised: AddGaussianNoise(1.0), drawn where the row is
    sampler = sampler_class(40, data.lengths, 1, 0, seed=3)
    loader = SampleFileLoader(
        data,
        batch_sampler=sampler,
        collate_fn=create_collate_fn(40),
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        persistent_workers=workers > 0,
    )
    return loader, sampler


def inputs(rows) -> list[torch.Tensor]:
    return [to_step_row(row, CPU, None).inputs["hidden_states"] for row in rows]


def test_the_workers_read_into_the_next_epoch_before_this_one_ends(tmp_path):
    write_files(tmp_path, LENGTHS)
    loader, sampler = stream_loader(tmp_path, workers=2, sampler_class=RecordingSampler)
    rows = list(loader.epoch_rows(0, last_epoch=2))
    assert len(rows) == len(sampler.batches(0)) >= 3
    sampler.planned.clear()
    # Nothing has asked for epoch 1 yet but the loader's own read-ahead (2 workers x 2 rows).
    next_rows = loader.epoch_rows(1, last_epoch=2)
    assert loader._stream_next is None and next(next_rows) is not None
    # The same iteration went on: epoch 1 was planned while epoch 0 was read (no restart).
    loader2, sampler2 = stream_loader(tmp_path, workers=2, sampler_class=RecordingSampler)
    list(loader2.epoch_rows(0, last_epoch=2))
    assert 1 in sampler2.planned  # asked for by the read-ahead, before epoch_rows(1)


def test_streamed_rows_equal_the_per_epoch_rows_noise_included(tmp_path):
    write_files(tmp_path, LENGTHS)
    for workers in (0, 2):
        loader, _ = stream_loader(tmp_path, workers)  # noise on: the default AddGaussianNoise(1.0)
        for epoch in range(3):
            streamed = inputs(loader.epoch_rows(epoch, last_epoch=2))
            expected = [row["hidden_states"] for row in noised_rows(tmp_path, epoch, workers=0)]
            assert len(streamed) == len(expected)
            assert all(torch.equal(a, b) for a, b in zip(streamed, expected, strict=True)), (
                workers,
                epoch,
            )


def test_a_resumed_stream_starts_inside_its_epoch_and_runs_on(tmp_path):
    write_files(tmp_path, LENGTHS)
    loader, _ = stream_loader(tmp_path, 2)
    resumed = inputs(loader.epoch_rows(1, 2, last_epoch=2))
    expected = [row["hidden_states"] for row in noised_rows(tmp_path, 1, start_step=2)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))
    following = inputs(loader.epoch_rows(2, last_epoch=2))
    expected = [row["hidden_states"] for row in noised_rows(tmp_path, 2)]
    assert all(torch.equal(a, b) for a, b in zip(following, expected, strict=True))


def _plan_rows(folder, epoch: int, start_step: int = 0) -> list[dict]:
    """The rows of `epoch` from `start_step` as a fresh per-epoch loader gives them: which
    samples (the position in the epoch's plan) and their noise (the epoch's)."""
    data = dataset(folder, 40)
    sampler = MultipackDistributedBatchSamplerV2(40, data.lengths, 1, 0, seed=3)
    loader = SampleFileLoader(data, batch_sampler=sampler, collate_fn=create_collate_fn(40))
    sampler.set_epoch(epoch, start_step)
    data.set_epoch(epoch)
    return list(loader)


def assert_same_rows(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for position, (row, want) in enumerate(zip(got, expected, strict=True)):
        assert row["sample_indices"].tolist() == want["sample_indices"].tolist(), position
        assert row["row_noise"].epoch == want["row_noise"].epoch, position
        assert torch.equal(
            to_step_row(row, CPU, None).inputs["hidden_states"],
            to_step_row(want, CPU, None).inputs["hidden_states"],
        ), position


def test_an_epoch_left_early_restarts_the_iteration_where_asked(tmp_path):
    write_files(tmp_path, LENGTHS)
    loader, _ = stream_loader(tmp_path, 2)
    rows = loader.epoch_rows(0, last_epoch=2)
    next(
        rows
    )  # stopped after one row (max_steps, an error): the stream is not where epoch 1 starts
    # Asked again for epoch 0: its rows from the first, not the stream's next ones.
    assert_same_rows(list(loader.epoch_rows(0, last_epoch=2)), _plan_rows(tmp_path, 0))
    rows = loader.epoch_rows(1, last_epoch=2)
    next(rows)
    # Asked for epoch 1 from step 2 (a resume): those rows, with epoch 1's noise.
    assert_same_rows(list(loader.epoch_rows(1, 2, last_epoch=2)), _plan_rows(tmp_path, 1, 2))
    # And the next epoch goes on from there.
    assert_same_rows(list(loader.epoch_rows(2, last_epoch=2)), _plan_rows(tmp_path, 2))


def test_plain_iteration_and_foreign_samplers_keep_their_per_epoch_behaviour(tmp_path):
    write_files(tmp_path, LENGTHS)
    loader, sampler = stream_loader(tmp_path, 2)
    assert isinstance(loader.batch_sampler, RunThroughBatchSampler)
    sampler.set_epoch(1)
    assert len(list(loader)) == len(sampler.batches(1)) == len(loader)
    loader.batch_sampler.set_epoch(2, 1)  # forwarded to the wrapped sampler
    assert (sampler.epoch, sampler.position) == (2, 1)
    wrapped = RunThroughBatchSampler([[0], [1, 2]])  # a plain list of batches: no `batches(epoch)`
    assert not wrapped.can_run_through and list(wrapped) == [[0], [1, 2]]
