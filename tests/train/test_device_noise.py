"""Noise drawn where the packed row is (#28): per sample span, independent of workers and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.sample_io import write_sample
from speculators_vllm016.train.data import Eagle3SampleFileDataset, create_collate_fn
from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators_vllm016.train.loading.device_rows import prefetch_to_device, to_step_row
from speculators_vllm016.train.loading.sample_loader import SampleFileLoader
from speculators_vllm016.train.noise_transforms import AddGaussianNoise, AddUniformNoise, RowNoise

HIDDEN = 4
CPU = torch.device("cpu")


def zero_sample(length: int) -> dict:
    """States of zeros: whatever is not zero after the noise was noised."""
    return {
        "input_ids": torch.arange(1, length + 1),
        "hidden_states": [torch.zeros(length, HIDDEN, dtype=torch.bfloat16) for _ in range(4)],
        "loss_mask": torch.ones(length, dtype=torch.long),
    }


def write_files(folder: Path, lengths: list[int]) -> None:
    for index, length in enumerate(lengths):
        write_sample(folder / f"data_{index}.pt", zero_sample(length))


def dataset(folder: Path, max_len: int, transform=None) -> Eagle3SampleFileDataset:
    return Eagle3SampleFileDataset(
        max_len,
        datapath=str(folder),
        transform=transform or AddGaussianNoise(1.0),
        seed=7,
        output_dtype=torch.bfloat16,
        device_noise=True,
    )


def on_device(row: dict, data: Eagle3SampleFileDataset) -> dict:
    """The model inputs of `row` as a step gets them (noised as `SampleFileLoader`'s rows are)."""
    row["row_noise"] = data.row_noise()
    return to_step_row(row, CPU, None).inputs


def noised_rows(folder: Path, epoch: int, *, workers: int = 0, start_step: int = 0) -> list[dict]:
    """The rows of `epoch` as the trainer sees them, from a fresh loader (a fresh process's)."""
    data = dataset(folder, 40)
    sampler = MultipackDistributedBatchSamplerV2(40, data.lengths, 1, 0, seed=3)
    loader = SampleFileLoader(
        data,
        batch_sampler=sampler,
        collate_fn=create_collate_fn(40),
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    rows = []
    for current in range(epoch + 1):  # earlier epochs run too: persistent workers live on
        sampler.set_epoch(current, start_step if current == epoch else 0)
        data.set_epoch(current)
        rows = [to_step_row(row, CPU, None).inputs for row in loader]
    return rows


def test_the_noise_fills_exactly_each_samples_span_and_spares_the_padding(tmp_path):
    write_files(tmp_path, [9, 13, 30])
    data = dataset(tmp_path, 40)
    row = create_collate_fn(40)([data[0], data[1], data[2]])  # 8 + 12 + 29: the last one cut to 20
    assert row["lengths"].tolist() == [8, 12, 20] and row["sample_indices"].tolist() == [0, 1, 2]
    assert row["hidden_states"].dtype == torch.bfloat16 and not row["hidden_states"].any()
    inputs = on_device(row, data)
    noised = inputs["hidden_states"][0].ne(0).all(dim=-1)
    assert noised[:40].all()  # every token of every span, the cut one to the row's end
    short = create_collate_fn(40)([data[0], data[1]])
    inputs = on_device(short, data)
    per_token = inputs["hidden_states"][0].ne(0).any(dim=-1)
    assert per_token[:20].all() and not per_token[20:].any()  # the padding stays zero
    assert not inputs["verifier_last_hidden_states"].any()  # the teacher stays clean
    assert not short["hidden_states"].any()  # the loader's row is not changed on the CPU


def test_a_samples_noise_is_its_own_wherever_it_is_packed(tmp_path):
    # Ranks and packing put a sample anywhere in a row: its noise depends on (seed, epoch, index).
    write_files(tmp_path, [9, 13])
    data = dataset(tmp_path, 40)
    collate = create_collate_fn(40)
    together = on_device(collate([data[0], data[1]]), data)["hidden_states"][0]
    alone = on_device(collate([data[1]]), data)["hidden_states"][0]
    assert together[8:20].any() and torch.equal(together[8:20], alone[:12])
    torch.manual_seed(99)  # the global generator plays no part
    assert torch.equal(on_device(collate([data[1]]), data)["hidden_states"][0], alone)
    row = collate([data[1]])
    RowNoise(data.transform, 7, 1).apply(
        {"hidden_states": row["hidden_states"]},
        row["lengths"].tolist(),
        row["sample_indices"].tolist(),
    )
    assert not torch.equal(row["hidden_states"][0], alone)  # another epoch, other noise
    clean = to_step_row(collate([data[1]]), CPU, None).inputs["hidden_states"]
    assert not clean.any()  # a row without its RowNoise (validation) is not noised


@pytest.mark.parametrize("transform", [AddGaussianNoise(0.5), AddUniformNoise(0.5)])
def test_the_noise_does_not_depend_on_the_workers_nor_on_resume(tmp_path, transform):
    write_files(tmp_path, [9, 13, 17, 21, 11, 15, 19, 7])
    reference = noised_rows(tmp_path, 1)
    assert len(reference) >= 3
    assert any(row["hidden_states"].any() for row in reference)
    in_workers = noised_rows(tmp_path, 1, workers=2)  # persistent workers, second epoch
    resumed = noised_rows(tmp_path, 1, start_step=2)  # a resumed run's fresh loader
    assert [
        torch.equal(a["hidden_states"], b["hidden_states"])
        for a, b in zip(in_workers, reference, strict=True)
    ] == [True] * len(reference)
    for a, b in zip(resumed, reference[2:], strict=True):
        assert torch.equal(a["hidden_states"], b["hidden_states"])
    first_epoch = noised_rows(tmp_path, 0)
    assert not all(
        torch.equal(a["hidden_states"], b["hidden_states"])
        for a, b in zip(first_epoch, reference, strict=False)
    )


def test_prefetch_applies_the_same_noise_as_the_plain_copy(tmp_path):
    write_files(tmp_path, [9, 13])
    data = dataset(tmp_path, 40)
    row = create_collate_fn(40)([data[0], data[1]])
    plain = on_device(row, data)["hidden_states"]
    fetched = next(prefetch_to_device([row], CPU, None)).inputs["hidden_states"]
    assert plain.any() and torch.equal(plain, fetched)


def test_the_finiteness_check_in_bf16_refuses_nan_and_inf_but_not_large_values():
    from speculators_vllm016.train.stored_states import all_finite as _all_finite

    large = torch.full((64, 8), 3e38, dtype=torch.bfloat16)  # finite; their sum is not
    assert _all_finite(large)
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = large.clone()
        values[5, 3] = bad
        assert not _all_finite(values)


def test_a_main_process_loader_noises_like_the_worker_loader(tmp_path):
    # Online extraction collates in the main process: its rows get the same noise as offline's.
    from speculators_vllm016.train.loading.sample_loader import main_process_noise

    write_files(tmp_path, [9, 13])
    data = dataset(tmp_path, 40)
    data.set_epoch(2)
    row = main_process_noise(create_collate_fn(40), data)([data[0], data[1]])
    assert row["row_noise"] == RowNoise(data.transform, 7, 2)
    offline = on_device(create_collate_fn(40)([data[0], data[1]]), data)["hidden_states"]
    assert torch.equal(to_step_row(row, CPU, None).inputs["hidden_states"], offline)


def _ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest gap between the empirical CDFs of `a` and `b` (ties counted alike in both)."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    points = torch.cat([a, b]).unique()
    cdf_a = torch.searchsorted(a, points, right=True).double() / a.numel()
    cdf_b = torch.searchsorted(b, points, right=True).double() / b.numel()
    return float((cdf_a - cdf_b).abs().max())


@pytest.mark.parametrize(
    ("transform", "variance"),
    [
        (AddUniformNoise(0.5), 0.5**2 / 3),  # U(-s, s): mean 0, variance s^2 / 3
        (AddGaussianNoise(0.5), 0.5**2),  # N(0, s^2)
    ],
)
def test_the_device_noise_has_the_cpu_transforms_distribution(transform, variance):
    # 0.3.0's transforms define the noise (uniform over [-s, s], Gaussian of std s); the device
    # path (RowNoise on a packed bf16 row) must draw the same distribution, not merely some noise.
    samples, length = 64, 1024  # 64 samples of 1024 tokens x HIDDEN: 262144 values per side
    row = {"hidden_states": torch.zeros(1, samples * length, HIDDEN, dtype=torch.bfloat16)}
    RowNoise(transform, seed=5, epoch=0).apply(row, [length] * samples, list(range(samples)))
    device = row["hidden_states"].flatten().double()
    torch.manual_seed(11)
    cpu_states = transform({"hidden_states": torch.zeros(samples * length, HIDDEN)})[
        "hidden_states"
    ]
    cpu = cpu_states.to(torch.bfloat16).flatten().double()  # rounded as training rounds it
    count = device.numel()
    for values in (device, cpu):  # each against the definition, 6 standard errors wide
        assert abs(float(values.mean())) < 6 * (variance / count) ** 0.5
        spread = float((values**2).std()) / count**0.5  # standard error of the variance
        assert abs(float((values**2).mean()) - variance) < 6 * spread
    if isinstance(transform, AddUniformNoise):  # the whole of [-s, s] and nothing outside
        assert float(device.min()) >= -0.5 and float(device.max()) <= 0.5
        assert float(device.min()) < -0.499 and float(device.max()) > 0.499
    # Two-sample Kolmogorov-Smirnov at significance 1e-6: c = sqrt(-ln(0.5e-6) / 2) = 2.69.
    assert _ks_distance(device, cpu) < 2.69 * (2 / count) ** 0.5
