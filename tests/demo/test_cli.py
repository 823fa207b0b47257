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
    # Long target rows as long as the long prompts below (the default 2,048 would cost more).
    "--target-long-row-tokens",
    "640",
    "--epochs",
    "4",
    "--lr",
    "2e-3",
    "--eval-prompts",
    "8",
    "--max-new-tokens",
    "16",
    "--regenerate-max-tokens",
    "32",
    "--long-context",
    "600",
    "--no-progress",
]
STAGES = [
    "split",
    "target",
    "datagen",
    "vocab",
    "initial draft",
    "train",
    "regen datagen",
    "regen vocab",
    "regen train",
    "eval",
    "serve",
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


def test_both_trained_drafts_beat_the_untrained_one_and_every_tau_is_reported(demo_run):
    root, _, (state, _) = demo_run
    figures = state["eval"]["figures"]
    before = figures["tau_untrained"]
    assert before < 1.1, f"an untrained draft should get almost nothing accepted (tau {before})"
    report = json.loads((root / "eval" / "eval.json").read_text())
    assert [d["label"] for d in report["drafts"]] == ["untrained", "shipped", "regenerated"]
    # Both trained drafts learned something; the tiny target's regenerated data is far smaller
    # (rows it answered with nothing are dropped, answers are cut at 32 tokens), so its draft
    # trains fewer steps and is only asked to beat the untrained one.
    for index, (label, margin) in enumerate((("shipped", 0.2), ("regenerated", 0.0)), start=1):
        after = figures[f"tau_{label}"]
        assert after > before + margin, f"tau untrained {before:.3f}, {label} {after:.3f}"
        assert figures[f"rates_{label}"][0] > figures["rates_untrained"][0] + margin / 2
        assert report["drafts"][index]["acceptance_length"] == after
        stage = "train" if label == "shipped" else "regen train"
        assert report["drafts"][index]["draft"] == state[stage]["outputs"]["trained_draft"]


def test_every_stage_reports_where_it_wrote_and_its_throughput(demo_run):
    root, _, (state, _) = demo_run
    stages = [name for name in state if name not in ("printed", "generators_started")]
    assert stages == STAGES
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


def _sample_names(data: Path) -> list[str]:
    return sorted(
        p.name for p in data.iterdir() if p.name.startswith("data_") and p.suffix == ".safetensors"
    )


def test_datagen_wrote_safetensors_samples_with_the_default_max_model_len(demo_run):
    root, started, _ = demo_run
    assert started[0]["max_model_len"] == 257  # --seq-length + 1
    assert started[1]["max_model_len"] == 256 + 32  # the longest prompt and its answer
    data = root / "data"
    names = _sample_names(data)
    assert names == sorted(f"data_{i}.safetensors" for i in range(64))
    hidden = json.loads((data / "data_config.json").read_text())["model"]["hidden_size"]
    for name in names[:8]:
        sample = load_sample(data / name)
        length = len(sample["input_ids"])
        assert 0 < length <= 256 and sample["loss_mask"].shape == (length,)
        assert 0 < int(sample["loss_mask"].sum()) < length
        assert all(layer.shape == (length, hidden) for layer in sample["hidden_states"])


def test_the_last_stage_serves_each_trained_draft_as_eval_measured_it_and_losslessly(demo_run):
    """vLLM's own counters give the hf engine's tau and per-position rates (greedy, fp32, the
    same prompts), and every speculative output is the plain engine's output (#45 item 4)."""
    _, _, (state, _) = demo_run
    served, measured = state["serve"]["figures"], state["eval"]["figures"]
    prompts = served["prompts"]
    assert prompts == state["eval"]["figures"]["prompts"]
    for label in ("shipped", "regenerated"):
        assert served[f"vllm_tau_{label}"] == pytest.approx(measured[f"tau_{label}"], abs=1e-12)
        assert served[f"vllm_rates_{label}"] == pytest.approx(measured[f"rates_{label}"], abs=1e-12)
        assert served[f"lossless_{label}"] == prompts
        assert served[f"tokens_per_second_{label}"] > 0
    assert served["plain_tokens_per_second"] > 0
    # The same questions after earlier turns of other conversations (#46): measured on the same
    # engines, lossless too, with each draft's tau there over its tau on the short prompts.
    assert served["long_context"] == 600
    assert 300 < served["long_prompt_tokens"] <= 600
    for label in ("shipped", "regenerated"):
        assert served[f"lossless_long_{label}"] == prompts
        long, short = served[f"vllm_tau_long_{label}"], served[f"vllm_tau_{label}"]
        assert long >= 1.0 and served[f"long_over_short_{label}"] == pytest.approx(long / short)
    printed = state["printed"]
    assert "-token prompts (--long-context 600): tau " in printed and "long/short " in printed
    assert "served by vLLM 0.16" in printed and "without speculation:" in printed
    assert f"outputs equal to plain greedy on {prompts}/{prompts}" in printed
    assert "what this shows:" in printed


def test_a_second_run_reuses_every_stage(demo_run):
    _, _, (first, second) = demo_run
    assert first["generators_started"] == second["generators_started"] == 2
    for name in STAGES:
        assert second[name] == first[name]
    assert second["printed"].count("(reused from an earlier run)") == len(STAGES)
    assert "(reused" not in first["printed"]


def test_the_summary_prints_stage_times_throughputs_and_tau(demo_run):
    _, _, (state, _) = demo_run
    printed = state["printed"]
    figures = state["eval"]["figures"]
    taus = ", ".join(
        f"{label} {figures[f'tau_{label}']:.3f}"
        for label in ("untrained", "shipped", "regenerated")
    )
    assert f"tau: {taus}" in printed
    held_out = state["split"]["figures"]["held_out_rows"]
    assert f"held-out questions for the evaluation (rows {held_out[0]}, " in printed
    for text in (
        "extraction:",
        "draft training:",
        "regenerated draft training:",
        "regeneration (greedy, by the target):",
        "tokens/s",
        "pos1",
        "training_curves.png",
    ):
        assert text in printed


def _rendered(tokenizer, conversations: list[list[dict]], length: int) -> list[tuple[int, ...]]:
    """Token ids of each conversation as datagen renders it, cut to `length`, sorted."""
    texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
    return sorted(
        tuple(tokenizer(text, add_special_tokens=False)["input_ids"][:length]) for text in texts
    )


def _data_ids(data: Path) -> list[tuple[int, ...]]:
    return sorted(
        tuple(int(t) for t in load_sample(data / name)["input_ids"]) for name in _sample_names(data)
    )


def test_the_regenerated_draft_trained_on_the_targets_answers_to_the_same_conversations(demo_run):
    from transformers import AutoTokenizer

    from speculators_vllm016.demo import read_conversations

    root, _, (state, _) = demo_run
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    shipped = list(read_conversations(root / "conversations" / "drafts.jsonl"))
    regenerated_file = root / "regenerated" / "conversations" / "conversations.jsonl"
    rows = [json.loads(line) for line in regenerated_file.read_text().splitlines()]
    regenerated = [row["messages"] for row in rows]
    regen = state["regen datagen"]["figures"]
    assert len(shipped) == 64 and regen["rows"] == 64
    assert len(rows) == regen["rows"] - regen["not_regenerated"] == regen["samples"] > 0
    for row in rows:  # the same questions up to the last answer, the target's answers
        original = shipped[row["row"]]
        last = max(i for i, m in enumerate(original) if m["role"] == "assistant")
        kept = original[: last + 1]
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in kept]
        assert [m for m in row["messages"] if m["role"] != "assistant"] == [
            m for m in kept if m["role"] != "assistant"
        ]
    answers = {
        i: [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        for i, row in enumerate(rows)
    }
    originals = {
        i: [m["content"] for m in shipped[row["row"]] if m["role"] == "assistant"]
        for i, row in enumerate(rows)
    }
    assert sum(answers[i] != originals[i][: len(answers[i])] for i in answers) >= len(rows) // 2

    shipped_ids = _data_ids(root / "data")
    regenerated_ids = _data_ids(root / "regenerated" / "data")
    assert shipped_ids == _rendered(tokenizer, shipped, 256)
    assert regenerated_ids == _rendered(tokenizer, regenerated, 256)
    assert regenerated_ids != shipped_ids
    assert state["regen train"]["outputs"]["checkpoints"] == str(
        root / "regenerated" / "checkpoints"
    )
    assert state["regen vocab"]["outputs"]["d2t"] == str(root / "regenerated" / "vocab" / "d2t.npy")


def test_the_evaluation_prompts_are_asked_in_no_training_conversation(demo_run):
    from speculators_vllm016.demo.held_out import row_questions

    root, _, (state, _) = demo_run
    report = json.loads((root / "eval" / "eval.json").read_text())
    held_out = Path(report["data_path"])
    assert held_out == root / "conversations" / "held-out.jsonl"
    prompts = [
        row_questions(line).opening
        for line in held_out.read_text().splitlines()[: report["num_prompts"]]
    ]
    assert report["num_prompts"] == state["eval"]["figures"]["prompts"] == 8
    trained_on = set()
    for name in ("target.jsonl", "drafts.jsonl"):
        for line in (root / "conversations" / name).read_text().splitlines():
            trained_on |= row_questions(line).asked
    regenerated_file = root / "regenerated" / "conversations" / "conversations.jsonl"
    for line in regenerated_file.read_text().splitlines():
        trained_on |= {m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"}
    assert None not in prompts and not set(prompts) & trained_on


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
