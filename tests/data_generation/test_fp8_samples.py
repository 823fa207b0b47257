"""Sample files stored as fp8 (`--storage-dtype fp8`): read back transparently, half the bytes,
refused clearly by 0.3.0's reader, recorded in data_config.json, never mixed in one folder."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.data_generation.config_generator import (
    DataGenerationConfig,
    FormatConfig,
)
from speculators_vllm016.data_generation.resume import RunIdentity, check_identity
from speculators_vllm016.data_generation.sample_io import (
    load_sample,
    quantized_sample,
    sample_path,
    write_sample,
)
from speculators_vllm016.utils.fp8_storage import error_bound
from tests.data_generation.test_sample_io import make_sample


def wide_sample(dtype: torch.dtype = torch.bfloat16) -> dict:
    sample = make_sample(seq=7, hidden=512)
    sample["hidden_states"] = [
        layer.to(dtype) * 10.0**k for k, layer in enumerate(sample["hidden_states"])
    ]
    return sample


@pytest.mark.parametrize("output_format", ["pt", "safetensors"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_file_reads_back_in_the_engines_dtype_within_the_bound(tmp_path, output_format, dtype):
    sample = wide_sample(dtype)
    path = sample_path(tmp_path, 0, output_format)
    write_sample(path, sample, output_format, storage_dtype="fp8")
    loaded = load_sample(path)
    assert set(loaded) == {"input_ids", "hidden_states", "loss_mask"}
    assert torch.equal(loaded["input_ids"], sample["input_ids"])
    assert torch.equal(loaded["loss_mask"], sample["loss_mask"])
    for got, want in zip(loaded["hidden_states"], sample["hidden_states"], strict=True):
        assert got.dtype == dtype
        scale = quantized_sample({**sample, "hidden_states": [want]})["hidden_states_scale"][0]
        # The bound, plus the rounding of the result to the engine's dtype.
        rounding = want.float().abs() * (2.0**-8 if dtype == torch.bfloat16 else 0.0)
        assert ((got.float() - want.float()).abs() <= error_bound(want, scale) + rounding).all()
    stored = load_sample(path, dequantize=False)
    assert stored["hidden_states_dtype"] == str(dtype).removeprefix("torch.")
    assert all(p.dtype == torch.float8_e4m3fn for p in stored["hidden_states_fp8"])


@pytest.mark.parametrize("output_format", ["pt", "safetensors"])
def test_fp8_file_takes_about_half_the_bytes_of_bf16(tmp_path, output_format):
    sample = make_sample(seq=256, hidden=1024)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bf16 = write_sample(sample_path(tmp_path / "a", 0, output_format), sample, output_format)
    fp8 = write_sample(
        sample_path(tmp_path / "b", 0, output_format), sample, output_format, storage_dtype="fp8"
    )
    states = 256 * 1024 * 4
    assert bf16 >= 2 * states and fp8 <= 0.55 * bf16
    assert fp8 >= states  # one byte a value: nothing silently dropped


def test_0_3_0_reader_stops_naming_the_missing_key(tmp_path):
    """0.3.0's trainer does `torch.load(file)` then `data["hidden_states"]` (its
    `standardize_data_v1`): on an fp8 file that is a KeyError naming the key, not garbage."""
    path = sample_path(tmp_path, 0, "pt")
    write_sample(path, wide_sample(), "pt", storage_dtype="fp8")
    data = torch.load(path)  # what 0.3.0's dataset reads
    with pytest.raises(KeyError, match="'hidden_states'"):
        torch.cat(data["hidden_states"][:-1], dim=-1)


def test_data_config_records_the_storage_dtype_and_old_configs_read_as_bf16():
    config = FormatConfig.create_default(4, 64, storage_dtype="fp8")
    assert config.storage_dtype == "fp8" and "hidden_states_fp8" in config.schema
    assert "hidden_states" not in config.schema
    raw = DataGenerationConfig(format=config).to_dict()
    assert raw["format"]["storage_dtype"] == "fp8"
    assert DataGenerationConfig.from_dict(raw).format.storage_dtype == "fp8"
    del raw["format"]["storage_dtype"]  # a data_config.json written before the flag
    assert DataGenerationConfig.from_dict(raw).format.storage_dtype == "bf16"
    assert FormatConfig.create_default(4, 64).schema["hidden_states"]["num_tensors"] == 4


def _identity(storage_dtype: str | None) -> RunIdentity:
    compared = {"target_model_path": "/m", "output_format": "pt", "samples_sha256": "x"}
    if storage_dtype is not None:
        compared["storage_dtype"] = storage_dtype
    return RunIdentity(compared=compared, informational={})


def test_resume_refuses_another_storage_dtype_in_one_folder(tmp_path):
    from speculators_vllm016.data_generation.resume import record_identity

    record_identity(tmp_path, _identity("fp8"))
    assert check_identity(tmp_path, _identity("fp8"), False) is False
    with pytest.raises(ValueError, match="storage_dtype: was 'fp8', now 'bf16'") as refused:
        check_identity(tmp_path, _identity("bf16"), False)
    assert "\n" not in str(refused.value)


def test_a_folder_recorded_before_the_flag_resumes_as_bf16_only(tmp_path):
    from speculators_vllm016.data_generation.resume import record_identity

    record_identity(tmp_path, _identity(None))  # a record of an earlier version: no such key
    assert check_identity(tmp_path, _identity("bf16"), False) is False
    with pytest.raises(ValueError, match="storage_dtype: was 'bf16', now 'fp8'"):
        check_identity(tmp_path, _identity("fp8"), False)


def test_the_run_identity_compares_the_storage_dtype():
    """What makes a resume with another --storage-dtype a different run (the engine test
    `test_offline.py::test_fp8_storage...` runs the refusal end to end)."""
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.data_generation.preflight import ModelFacts
    from speculators_vllm016.data_generation.resume import run_identity

    facts = ModelFacts(
        path="x", num_layers=4, hidden_size=8, layer_ids=[0, 1, 2, 3], config_dict={}
    )
    options = {"target_model_path": "x", "train_data_path": "y", "output_dir": "z"}
    fp8 = run_identity(DatagenOptions(**options, storage_dtype="fp8"), facts, "d")
    bf16 = run_identity(DatagenOptions(**options), facts, "d")
    assert fp8.compared["storage_dtype"] == "fp8" and bf16.compared["storage_dtype"] == "bf16"


def test_an_unknown_storage_dtype_is_refused_naming_the_flag():
    from speculators_vllm016.data_generation.options import DatagenOptions

    options = DatagenOptions(
        target_model_path="x", train_data_path="y", output_dir="z", storage_dtype="int4"
    )
    with pytest.raises(ValueError, match="--storage-dtype 'int4' is not one of bf16, fp8"):
        options.validate()
