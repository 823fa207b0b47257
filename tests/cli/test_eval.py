"""`speculators eval` end to end on the tiny Llama: table, JSON, PNG, tau_sim, engine choice."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.utils.command_errors import DEBUG_HINT
from tests.evaluate.drafts import build_draft

CONTEXT = 160  # the short-context target's window (test_drafts_of_different_k_...)

CONVERSATIONS = [
    {
        "conversations": [
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris is the capital of France."},
        ]
    },
    {"conversations": [{"from": "gpt", "value": "An answer without a question."}]},
    {
        "conversations": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Write a short poem about the sea."},
            {"role": "assistant", "content": "The sea is wide."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Numbers 0 1 2 3?"},
            {"from": "gpt", "value": "4 5 6 7 8 9."},
        ]
    },
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("eval_cli")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    for epoch, seed in ((0, 0), (1, 1)):
        build_draft(str(tiny_llama), seed=seed).save_pretrained(root / "ckpt" / str(epoch))
    metrics = [
        {
            "epoch": 0,
            "val/full_acc_0_epoch": 0.5,
            "val/full_acc_1_epoch": 0.25,
            "val/full_acc_2_epoch": 0.125,
        },
        {"epoch": 0, "step": 7, "full_acc_0": 0.9, "full_acc_1": 0.9, "full_acc_2": 0.9},
        {
            "epoch": 1,
            "val/full_acc_0_epoch": 0.75,
            "val/full_acc_1_epoch": 0.5,
            "val/full_acc_2_epoch": 0.25,
        },
    ]
    (root / "ckpt" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return root


def test_eval_compares_checkpoints_in_one_table_json_and_plot(workspace):
    out_json, out_png = workspace / "out" / "eval.json", workspace / "out" / "eval.png"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(workspace / "ckpt" / "0"),
            "--draft",
            str(workspace / "ckpt" / "1"),
            "--data-path",
            str(workspace / "chat.jsonl"),
            "--max-prompts",
            "3",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--engine",
            "hf",
            "--output-json",
            str(out_json),
            "--plot",
            str(out_png),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "engine hf" in result.output
    report = json.loads(out_json.read_text())
    assert report["num_prompts"] == 3 and report["engine"] == "hf"
    assert [d["label"] for d in report["drafts"]] == ["0", "1"]
    for draft, tau_sim in zip(report["drafts"], (1.875, 2.5)):
        assert draft["num_speculative_tokens"] == 3
        assert draft["generated_tokens"] == 3 * 8
        assert draft["acceptance_length"] == pytest.approx(
            1 + draft["num_accepted_tokens"] / draft["num_drafts"]
        )
        assert len(draft["per_position_acceptance_rate"]) == 3
        assert draft["tau_sim"] == pytest.approx(tau_sim)
        assert f"{tau_sim:.3f}" in result.output
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (workspace / "out").iterdir() if p.name.startswith(".")]


def test_eval_needs_a_readable_draft_and_says_so(workspace):
    result = CliRunner().invoke(
        app, ["eval", "--draft", str(workspace), "--data-path", str(workspace / "chat.jsonl")]
    )
    assert result.exit_code == 2
    assert "no config.json" in result.output


def test_drafts_of_different_k_are_measured_on_the_same_prompts(workspace, tmp_path):
    """--max-new-tokens that leaves room for the longest prompt with k=1 but not with k=5: that
    prompt is left out for both drafts, and the report counts the prompts they saw. The target
    is the tiny Llama with a CONTEXT-token window (the shared one's 1,024 made each draft
    generate ~1,000 tokens per prompt: 40 s of the suite for the same guarantee)."""
    from transformers import AutoTokenizer

    from speculators_vllm016.evaluate.prompts import load_eval_prompts
    from speculators_vllm016.tiny_models import build_tiny_llama

    tiny_llama = build_tiny_llama(tmp_path / "short", max_position_embeddings=CONTEXT)
    for k in (1, 5):
        build_draft(str(tiny_llama), speculative_tokens=k).save_pretrained(tmp_path / f"k{k}")
    lengths = [
        len(p)
        for p in load_eval_prompts(
            str(workspace / "chat.jsonl"),
            AutoTokenizer.from_pretrained(str(tiny_llama)),
            max_prompts=3,
        ).token_ids
    ]
    longest = max(lengths)
    new_tokens = CONTEXT - longest - 1 - 1  # room for the longest prompt and 1 draft token, not 5
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(tmp_path / "k1"),
            "--draft",
            str(tmp_path / "k5"),
            "--data-path",
            str(workspace / "chat.jsonl"),
            "--max-prompts",
            "3",
            "--max-new-tokens",
            str(new_tokens),
            "--ignore-eos",
            "--engine",
            "hf",
            "--output-json",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    fitting = sum(length + new_tokens + 5 + 1 <= CONTEXT for length in lengths)
    assert 0 < fitting < 3 and report["num_prompts"] == fitting
    assert [d["num_speculative_tokens"] for d in report["drafts"]] == [1, 5]
    assert [d["generated_tokens"] for d in report["drafts"]] == [fitting * new_tokens] * 2


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@pytest.mark.skipif(not _cpu_build(), reason="checks the refusal of vLLM's CPU build")
def test_engine_vllm_with_cpu_speculation_off_names_the_switch_and_engine_hf(
    workspace, monkeypatch
):
    monkeypatch.setenv("SPECULATORS_CPU_SPECULATION", "0")
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(workspace / "ckpt" / "0"),
            "--data-path",
            str(workspace / "chat.jsonl"),
            "--engine",
            "vllm",
        ],
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: vLLM's CPU build refuses speculative decoding (this package's CPU speculation is "
        "switched off: SPECULATORS_CPU_SPECULATION); use --engine hf " + DEBUG_HINT
    ]


def test_tensor_parallel_on_the_hf_engine_is_one_line_before_any_model_loads(workspace, tmp_path):
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(workspace / "ckpt" / "0"),
            "--data-path",
            str(workspace / "chat.jsonl"),
            "--engine",
            "hf",
            "--tensor-parallel-size",
            "8",
            "--output-json",
            str(out),
        ],
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: --tensor-parallel-size 8 needs the vllm engine; eval runs the hf engine "
        "here (--engine hf), which holds the verifier on one device " + DEBUG_HINT
    ]
    assert not out.exists()


def test_eval_reads_the_trainers_checkpoints_and_tau_sim(
    workspace, tiny_llama, training_data, tmp_path
):
    """Checkpoints and metrics.jsonl as `speculators train` writes them."""
    from speculators_vllm016.cli.train import main as train
    from tests.training_fixtures import train_args

    save = tmp_path / "ckpt"
    assert train(train_args(tiny_llama, training_data, save, "--epochs", "1")) == 0
    logged = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    expected = [
        line["val"]["tau_sim"] for line in logged if "val" in line and line.get("epoch") == 0
    ]
    out_json = tmp_path / "eval.json"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(save / "0"),
            "--data-path",
            str(workspace / "chat.jsonl"),
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--engine",
            "hf",
            "--output-json",
            str(out_json),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    draft = json.loads(out_json.read_text())["drafts"][0]
    assert expected and draft["tau_sim"] == pytest.approx(expected[-1])
    assert draft["generated_tokens"] > 0
    from speculators_vllm016.evaluate.training_metrics import find_training_estimate

    best = find_training_estimate(save / "best")  # the trainer's link to the best epoch
    assert best is not None and best.epoch == int(os.readlink(save / "best"))


def test_bad_output_paths_and_an_unreachable_verifier_get_one_line_errors(
    workspace, tmp_path, monkeypatch
):
    base = [
        "eval",
        "--draft",
        str(workspace / "ckpt" / "0"),
        "--data-path",
        str(workspace / "chat.jsonl"),
    ]
    result = CliRunner().invoke(app, [*base, "--output-json", str(tmp_path)])
    assert (
        result.exit_code == 2
        and "--output-json" in result.output
        and "is a folder" in result.output
    )
    # A hub id that cannot be fetched: transformers raises OSError.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(
        app, [*base, "--verifier", "no-such-org/no-such-model", "--engine", "hf"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1


def test_context_lengths_give_a_row_per_draft_and_length_with_tau_against_the_shortest(workspace):
    """`--context-lengths`: each question alone (0) and after earlier turns of the other
    conversations (about 120 tokens); JSON rows carry the length and the prompts' mean tokens."""
    out_json = workspace / "out" / "context.json"
    base = [
        "eval",
        "--draft",
        str(workspace / "ckpt" / "0"),
        "--data-path",
        str(workspace / "chat.jsonl"),
        "--max-prompts",
        "2",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--engine",
        "hf",
        "--no-progress",
    ]
    result = CliRunner().invoke(
        app, [*base, "--context-lengths", "120,0", "--output-json", str(out_json)]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out_json.read_text())["drafts"]
    assert [row["context_length"] for row in rows] == [0, 120]
    short, long = (row["mean_prompt_tokens"] for row in rows)
    assert short < long <= 120
    assert "vs shortest" in result.output and "1.000" in result.output
    # Positions the verifier lacks: one line before any model loads.
    result = CliRunner().invoke(app, [*base, "--context-lengths", "0,5000"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "--context-lengths 5000" in result.output
    assert len(result.output.strip().splitlines()) == 1
