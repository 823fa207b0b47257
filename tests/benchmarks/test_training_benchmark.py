"""The training-step benchmark runs its CPU preset end to end (no timing asserted)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.training import PRESETS, kernel_category, main, own_microseconds


def test_cpu_small_preset_runs_and_writes_its_records(tmp_path) -> None:
    result = main(
        [
            "--preset",
            "cpu-small",
            "--packed-tokens",
            "256",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--output-dir",
            str(tmp_path),
            "--tag",
            "test",
        ]
    )
    row = result["lengths"][0]
    assert row["error"] is None
    assert row["packed_tokens"] == 256 and len(row["step_seconds"]) == 2
    assert row["median_tokens_per_second"] > 0 and math.isfinite(row["final_loss"])
    saved = json.loads((tmp_path / "training-cpu-small-test.json").read_text())
    assert saved["settings"]["precision"] == "fp32"  # auto on a CPU
    assert saved["environment"]["torch"]
    markdown = (tmp_path / "training-cpu-small-test.md").read_text()
    assert "| 256 |" in markdown and "python benchmarks/training.py" in markdown


def test_gpu_presets_refuse_a_cpu(tmp_path) -> None:
    assert {"llama-3.1-8b-draft", "kimi-k2.5-draft", "cpu-small"} <= set(PRESETS)
    llama = PRESETS["llama-3.1-8b-draft"]
    assert (
        llama.hidden_size,
        llama.num_attention_heads,
        llama.num_key_value_heads,
        llama.head_dim,
        llama.intermediate_size,
        llama.target_vocab_size,
        llama.draft_vocab_size,
    ) == (4096, 32, 8, 128, 14336, 128256, 32000)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--preset", "llama-3.1-8b-draft", "--device", "cpu", "--output-dir", str(tmp_path)])


def test_profile_sorts_time_into_matmul_attention_optimizer_and_other(tmp_path) -> None:
    # Kernel names as an H200 profile of the llama preset shows them.
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_category("triton_tem_fused_flex_attention_backward_1") == "attention"
    assert (
        kernel_category(
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
            "(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, ...>"
        )
        == "optimizer"
    )
    assert kernel_category("triton_red_fused__log_softmax__to_copy_argmax_exp_mul_0") == "other"
    assert kernel_category("aten::addmm") == "matmul"
    result = main(
        [
            "--preset",
            "cpu-small",
            "--packed-tokens",
            "256",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--output-dir",
            str(tmp_path),
            "--profile",
        ]
    )
    profile = result["lengths"][0]["profile_ms"]
    assert set(profile) == {"matmul", "attention", "optimizer", "other", "total", "wall"}
    assert profile["matmul"] > 0 and profile["total"] > 0 and profile["wall"] > 0
    assert profile["total"] == pytest.approx(
        profile["matmul"] + profile["attention"] + profile["optimizer"] + profile["other"], abs=0.05
    )


def test_profile_counts_each_kernel_once():
    """On CUDA a profiler annotation (the optimizer's step) reports the device time of the
    kernels inside it: only the kernels themselves are counted."""
    from types import SimpleNamespace

    kernel = SimpleNamespace(
        device_type="cuda",
        is_user_annotation=False,
        self_device_time_total=4000.0,
        self_cpu_time_total=0.0,
    )
    annotation = SimpleNamespace(
        device_type="cuda",
        is_user_annotation=True,
        self_device_time_total=4000.0,
        self_cpu_time_total=10.0,
    )
    cpu_op = SimpleNamespace(
        device_type="cpu",
        is_user_annotation=False,
        self_device_time_total=4000.0,
        self_cpu_time_total=25.0,
    )
    assert [own_microseconds(e, True, "cuda") for e in (kernel, annotation, cpu_op)] == [
        4000.0,
        0,
        0,
    ]
    assert [own_microseconds(e, False, "cuda") for e in (kernel, annotation, cpu_op)] == [
        0.0,
        10.0,
        25.0,
    ]


@pytest.mark.parametrize("kind", ["random", "spans", "all"])
def test_synthetic_loss_masks_score_what_they_say(kind) -> None:
    import torch

    from benchmarks.training import TURN_TOKENS, synthetic_loss_mask

    mask = synthetic_loss_mask(kind, 8192, torch.Generator().manual_seed(0))
    assert mask.shape == (1, 8192)
    share = float(mask.float().mean())
    assert share == 1.0 if kind == "all" else abs(share - 0.7) < 0.02
    if kind == "spans":  # every turn: one masked prompt, then one scored response
        turns = mask[0].view(-1, TURN_TOKENS)
        assert bool((turns == turns[0]).all()) and int(turns[0].diff().abs().sum()) == 1
        assert int(turns[0, 0]) == 0 and int(turns[0, -1]) == 1
    with pytest.raises(ValueError, match="loss mask kind"):
        synthetic_loss_mask("bernoulli", 16, None)
