"""Rows of fp8 sample files (`--storage-dtype fp8`): the loader's workers move the fp8 payload and
its scales; the states are dequantized on the training device, to the values the files hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.sample_io import load_sample, write_sample
from speculators_vllm016.train.data import (
    Eagle3SampleFileDataset,
    SampleFileError,
    create_collate_fn,
)
from speculators_vllm016.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators_vllm016.train.loading.device_rows import to_step_row
from speculators_vllm016.train.loading.row_slots import HostRowSlots
from speculators_vllm016.train.loading.sample_loader import SampleFileLoader
from speculators_vllm016.train.noise_transforms import AddGaussianNoise
from speculators_vllm016.train.stored_states import fp8_row_layers
from speculators_vllm016.utils.fp8_storage import dequantize

HIDDEN = 8
MAX_LEN = 40
LENGTHS = [9, 13, 17, 21, 11, 15, 19, 7, 12, 16, 10, 14]
CPU = torch.device("cpu")


def write_files(folder: Path, storage_dtype: str = "fp8", lengths=LENGTHS) -> None:
    """Distinct states per sample, token and layer, over several magnitudes."""
    generator = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    for index, length in enumerate(lengths):
        layers = [
            (torch.randn(length, HIDDEN, generator=generator) * 10.0 ** (layer - 1)).bfloat16()
            for layer in range(4)
        ]
        sample = {
            "input_ids": torch.arange(index, index + length),
            "hidden_states": layers,
            "loss_mask": (torch.arange(length) % 3 != 0).long(),
        }
        write_sample(folder / f"data_{index}.pt", sample, storage_dtype=storage_dtype)


def expected_states(path: Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, teacher) of one file, shifted as in a row, dequantized as on the device (the
    scale in the row's dtype)."""
    stored = load_sample(path, dequantize=False)
    layers = [
        dequantize(payload, scale.to(dtype), dtype)
        for payload, scale in zip(stored["hidden_states_fp8"], stored["hidden_states_scale"])
    ]
    return torch.cat(layers[:-1], dim=-1)[:-1], layers[-1][1:]


def dataset(folder: Path, dtype: torch.dtype | None, **options) -> Eagle3SampleFileDataset:
    """The trainer's dataset; its noise of width 0 makes rows name their samples and runs where
    the trainer's does (after the dequantization, on the device) without changing a value."""
    return Eagle3SampleFileDataset(
        MAX_LEN,
        datapath=str(folder),
        seed=7,
        output_dtype=dtype,
        device_noise=True,
        transform=AddGaussianNoise(0.0),
        **options,
    )


def check_rows(rows: list[dict], data: Eagle3SampleFileDataset, dtype: torch.dtype) -> int:
    """Every row's states on the device equal the files' dequantized values; returns the count."""
    for row in rows:
        assert row["hidden_states"].dtype == torch.float8_e4m3fn  # not dequantized in a worker
        assert row["verifier_last_hidden_states"].dtype == torch.float8_e4m3fn
        row["row_noise"] = data.row_noise()
        inputs = to_step_row(row, CPU, None).inputs
        assert inputs["hidden_states"].dtype == dtype
        assert not any(key.endswith("_scale") for key in inputs)
        used = 0
        for index, length in zip(row["sample_indices"].tolist(), row["lengths"].tolist()):
            fused, last = expected_states(data.data[index], dtype)
            assert torch.equal(inputs["hidden_states"][0, used : used + length], fused[:length])
            assert torch.equal(
                inputs["verifier_last_hidden_states"][0, used : used + length], last[:length]
            )
            used += length
        assert not inputs["hidden_states"][0, used:].any()  # the padding stays zero
    return len(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_collated_rows_are_dequantized_on_the_device_to_the_files_values(tmp_path, dtype):
    write_files(tmp_path)
    data = dataset(tmp_path, dtype if dtype == torch.bfloat16 else None, device_dequantize=True)
    collate = create_collate_fn(MAX_LEN)
    rows = [collate([data[0], data[1]]), collate([data[2], data[3], data[4]])]
    assert check_rows(rows, data, dtype) == 2


def test_worker_rows_through_host_slots_carry_fp8_and_dequantize_on_the_device(tmp_path):
    write_files(tmp_path)
    data = dataset(tmp_path, torch.bfloat16, device_dequantize=True)
    assert fp8_row_layers(data) == (3, 1)
    sampler = MultipackDistributedBatchSamplerV2(MAX_LEN, data.lengths, 1, 0, seed=3)
    slots = HostRowSlots.for_dataset(data, MAX_LEN, rows_in_flight=4, count=4)
    assert slots.buffers["hidden_states"].dtype == torch.float8_e4m3fn
    assert slots.buffers["hidden_states_scale"].shape[-1] == 3
    loader = SampleFileLoader(
        data,
        batch_sampler=sampler,
        collate_fn=create_collate_fn(MAX_LEN),
        num_workers=2,
        prefetch_factor=2,
        persistent_workers=True,
        row_slots=slots,
    )
    try:
        sampler.set_epoch(0)
        checked = 0
        for row in loader:  # each row is checked before the next is taken (its slot is held)
            checked += check_rows([row], data, torch.bfloat16)
        assert checked == len(sampler)
    finally:
        loader.close()


def test_without_device_dequantization_the_rows_hold_the_engines_values(tmp_path):
    """A reader that is not the trainer (0.3.0's API through the shim) gets plain states."""
    write_files(tmp_path)
    data = Eagle3SampleFileDataset(MAX_LEN, datapath=str(tmp_path))
    row = create_collate_fn(MAX_LEN)([data[0]])
    assert row["hidden_states"].dtype == torch.float32 and "hidden_states_scale" not in row
    plain = load_sample(data.data[0])["hidden_states"]
    assert torch.equal(row["hidden_states"][0, :8], torch.cat(plain[:-1], -1)[:-1].float())


def test_a_row_mixing_fp8_and_bf16_files_is_refused_in_one_line(tmp_path):
    write_files(tmp_path / "fp8", lengths=[9])
    write_files(tmp_path / "bf16", "bf16", lengths=[9])
    files = [str(tmp_path / "fp8" / "data_0.pt"), str(tmp_path / "bf16" / "data_0.pt")]
    data = Eagle3SampleFileDataset(
        MAX_LEN, file_list=files, output_dtype=torch.bfloat16, device_dequantize=True
    )
    with pytest.raises(SampleFileError, match="--storage-dtype") as refused:
        create_collate_fn(MAX_LEN)([data[0], data[1]])
    assert "\n" not in str(refused.value)


def test_non_finite_states_in_an_fp8_file_are_refused(tmp_path):
    write_files(tmp_path, lengths=[9])
    sample = load_sample(tmp_path / "data_0.pt")
    sample["hidden_states"][1][4, 2] = float("inf")
    write_sample(tmp_path / "data_0.pt", sample, storage_dtype="fp8")
    data = dataset(tmp_path, torch.bfloat16, device_dequantize=True)
    with pytest.raises(SampleFileError, match="NaN or inf"):
        data.load(0)
