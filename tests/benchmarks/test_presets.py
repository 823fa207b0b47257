"""Every preset parses and resolves its settings; GPU presets refuse a machine without GPUs."""

from __future__ import annotations

import pytest

from benchmarks.extraction import main, parse_args
from benchmarks.presets import PRESETS, HardwareError, build_settings, check_hardware

GPU_PRESETS = [name for name, preset in PRESETS.items() if preset.requires_gpu]


def test_expected_presets_exist() -> None:
    assert {"smoke", "cpu-small", "kimi-k2.5-8xrtxpro6000"} <= set(PRESETS)
    assert {name for name in GPU_PRESETS if "llama" in name} and any(
        "qwen3" in n for n in GPU_PRESETS
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_its_settings(name: str, tmp_path) -> None:
    argv = ["--preset", name, "--output-dir", str(tmp_path), "--repeats", "2"]
    if PRESETS[name].model is None and PRESETS[name].tiny_model is None:
        argv += ["--model", "/models/Kimi-K2.5"]
    settings = parse_args(argv)
    assert settings.preset.name == name
    assert settings.repeats == 2
    assert settings.model is not None or settings.preset.tiny_model is not None
    assert settings.preset.workload.max_length < settings.preset.max_model_len
    record = settings.to_dict()
    assert record["preset"]["tensor_parallel_size"] == settings.preset.tensor_parallel_size


def test_kimi_preset_needs_model() -> None:
    with pytest.raises(ValueError, match="needs --model"):
        build_settings("kimi-k2.5-8xrtxpro6000")
    settings = build_settings("kimi-k2.5-8xrtxpro6000", model="/m")
    assert settings.preset.tensor_parallel_size == 8 and settings.skip_hf


def test_overrides_apply_and_are_recorded() -> None:
    settings = parse_args(["--preset", "cpu-small", "--dtype", "float32", "--batch-size", "7"])
    assert settings.preset.dtype == "float32" and settings.preset.batch_size == 7
    assert settings.overrides == {"dtype": "float32", "batch_size": 7}


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        build_settings("nope")
    with pytest.raises(ValueError, match="repeats"):
        build_settings("smoke", repeats=0)
    with pytest.raises(ValueError, match="max_model_len"):
        build_settings("cpu-small", max_model_len=64)


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_fail_clearly_without_gpus(name: str) -> None:
    settings = build_settings(name, model="/m")
    needed = settings.preset.world_size
    with pytest.raises(HardwareError) as error:
        check_hardware(settings, device_count=needed - 1)
    message = str(error.value)
    assert f"needs {needed} CUDA GPU" in message and settings.preset.hardware in message
    assert f"found {needed - 1}" in message
    check_hardware(settings, device_count=needed)  # enough GPUs: no complaint


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_stop_before_starting_anything_here(name: str, tmp_path, capsys) -> None:
    import torch

    if torch.cuda.device_count() >= PRESETS[name].world_size:
        pytest.skip("this machine has the GPUs")
    rc = main(["--preset", name, "--model", "/m", "--output-dir", str(tmp_path / "out")])
    assert rc == 2
    assert "needs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cpu_presets_need_no_gpu() -> None:
    for name in ("smoke", "cpu-small"):
        check_hardware(build_settings(name), device_count=0)
