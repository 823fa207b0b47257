"""`speculators demo`: the README's first command, end to end in a smaller setting (one shared run)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from speculators_vllm016.data_generation import vllm_hidden_states_generator as generator_module
from speculators_vllm016.data_generation.sample_io import load_sample
from speculators_vllm016.demo import cli as demo

pytestmark = pytest.mark.engine

SMALL = [
    "--max-samples",
    "64",
    "--seq-length",
    "256",
    "--batch-size",
    "16",
    "--output-format",
    "safetensors",
    "--target-steps",
    "24",
    "--epochs",
    "4",
    "--lr",
    "2e-3",
    "--eval-prompts",
    "8",
    "--max-new-tokens",
    "16",
    "--no-progress",
]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One demo run, then a second call on the same folder; what each printed and started."""
    started = []
    real_init = generator_module.VllmHiddenStatesGenerator.__init__

    def recording_init(self, *args, **kwargs):  # a spy: the real generator still starts
        started.append(kwargs)
        real_init(self, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(generator_module.VllmHiddenStatesGenerator, "__init__", recording_init)
    root = tmp_path_factory.mktemp("demo") / "out"
    outputs = []
    try:
        for _ in range(2):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                assert demo.main(["--output-dir", str(root), *SMALL]) == 0
            outputs.append(json.loads((root / "demo_state.json").read_text()))
            outputs[-1]["printed"] = printed.getvalue()
            outputs[-1]["generators_started"] = len(started)
    finally:
        patch.undo()
    return root, started, outputs


def test_the_trained_draft_beats_the_untrained_one(demo_run):
    root, _, (state, _) = demo_run
    figures = state["eval"]["figures"]
    before, after = figures["tau_untrained"], figures["tau_trained"]
    assert before < 1.1, f"an untrained draft should get almost nothing accepted (tau {before})"
    assert after >= before + 0.2, f"tau untrained {before:.3f}, trained {after:.3f}"
    assert figures["rates_trained"][0] > figures["rates_untrained"][0] + 0.15
    report = json.loads((root / "eval" / "eval.json").read_text())
    assert [d["label"] for d in report["drafts"]] == ["untrained", "trained"]
    assert report["drafts"][1]["acceptance_length"] == after


def test_every_stage_reports_where_it_wrote_and_its_throughput(demo_run):
    root, _, (state, _) = demo_run
    stages = [name for name in state if name not in ("printed", "generators_started")]
    assert stages == ["target", "datagen", "vocab", "initial draft", "train", "eval"]
    assert state["target"]["figures"]["last_loss"] < state["target"]["figures"]["first_loss"]
    assert state["datagen"]["figures"]["tokens_per_second"] > 0
    assert state["train"]["figures"]["tokens_per_second"] > 0
    for name in ("curves", "metrics", "trained_draft"):
        assert Path(state["train"]["outputs"][name]).exists()
    assert (root / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "eval" / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "vocab" / "d2t.npy").is_file() and (
        root / "draft-untrained" / "config.json"
    ).is_file()


def test_datagen_wrote_safetensors_samples_with_the_default_max_model_len(demo_run):
    root, started, _ = demo_run
    assert started[0]["max_model_len"] == 257  # --seq-length + 1
    data = root / "data"
    names = sorted(
        p.name for p in data.iterdir() if p.name.startswith("data_") and p.suffix == ".safetensors"
    )
    assert names == sorted(f"data_{i}.safetensors" for i in range(64))
    hidden = json.loads((data / "data_config.json").read_text())["model"]["hidden_size"]
    for name in names[:8]:
        sample = load_sample(data / name)
        length = len(sample["input_ids"])
        assert 0 < length <= 256 and sample["loss_mask"].shape == (length,)
        assert 0 < int(sample["loss_mask"].sum()) < length
        assert all(layer.shape == (length, hidden) for layer in sample["hidden_states"])


def test_a_second_run_reuses_every_stage(demo_run):
    _, _, (first, second) = demo_run
    assert first["generators_started"] == second["generators_started"] == 1
    for name in ("target", "datagen", "vocab", "initial draft", "train", "eval"):
        assert second[name] == first[name]
    assert second["printed"].count("(reused from an earlier run)") == 6
    assert "(reused" not in first["printed"]


def test_the_summary_prints_stage_times_throughputs_and_tau(demo_run):
    _, _, (state, _) = demo_run
    printed = state["printed"]
    figures = state["eval"]["figures"]
    assert (
        f"tau: untrained {figures['tau_untrained']:.3f} -> trained {figures['tau_trained']:.3f}"
        in printed
    )
    for text in ("extraction:", "draft training:", "tokens/s", "pos1", "training_curves.png"):
        assert text in printed


@pytest.mark.parametrize(("environment", "offline"), [(None, True), ("0", False)])
def test_the_demo_works_offline_even_after_the_hub_was_imported(monkeypatch, environment, offline):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; the CLI imports it before `demo`
    runs. A user's own HF_HUB_OFFLINE=0 is left alone."""
    import huggingface_hub.constants

    from speculators_vllm016.demo.cli import work_offline

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    if environment is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", environment)
    work_offline()
    assert huggingface_hub.constants.HF_HUB_OFFLINE is offline
    assert os.environ["HF_HUB_OFFLINE"] == (environment or "1")
