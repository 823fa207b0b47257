"""`speculators eval --engine vllm` on vLLM 0.16's CPU build equals `--engine hf` (#45 item 3).

Same draft, prompts and greedy sampling in fp32 on the tiny Llama: vLLM's own counters
(`vllm:spec_decode_num_drafts`, accepted tokens per position) must give exactly the drafts,
accepted tokens, tau and per-position rates that the hf engine counts. The draft is a logit-lens
draft (tests/evaluate/drafts.py), so acceptance is neither 0 nor all and a miscount shows.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from tests.evaluate.drafts import logit_lens_draft

pytestmark = pytest.mark.engine

QUESTIONS = [
    "What is the capital of France?",
    "Count: 1 2 3 4",
    "Write a short poem about the sea and the wind over it, please.",
    "Why?",
    "Explain speculative decoding in one sentence.",
]


def test_engine_vllm_counts_what_engine_hf_counts(tiny_llama, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]}
            )
            + "\n"
            for q in QUESTIONS
        )
    )
    draft = tmp_path / "draft"
    logit_lens_draft(str(tiny_llama), "LlamaForCausalLM", (1, 2, 3)).save_pretrained(draft)
    rows = {}
    for engine in ("vllm", "hf"):
        out = tmp_path / f"{engine}.json"
        result = CliRunner().invoke(
            app,
            [
                "eval",
                "--draft",
                str(draft),
                "--data-path",
                str(data),
                "--max-new-tokens",
                "16",
                "--ignore-eos",
                "--dtype",
                "float32",
                "--engine",
                engine,
                "--output-json",
                str(out),
                "--no-progress",
            ],
        )
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["engine"] == engine
        rows[engine] = report["drafts"][0]
    served, reference = rows["vllm"], rows["hf"]
    assert 1.0 < reference["acceptance_length"] < 4.0, reference
    for key in (
        "num_drafts",
        "num_accepted_tokens",
        "acceptance_length",
        "per_position_acceptance_rate",
        "generated_tokens",
    ):
        assert served[key] == reference[key], (key, served[key], reference[key])
