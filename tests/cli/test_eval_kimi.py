"""`speculators eval --engine hf` on the tiny Kimi-K2.5 (#36 item 2): the wrapper's language model
is the verifier, so a draft measures as on the plain DeepSeek-V3 with the same weights."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from tests.evaluate.drafts import logit_lens_draft
from tests.kimi_variants import with_remote_code, with_vision_tower

CONVERSATIONS = [
    {
        "conversations": [
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Count: 1 2 3 4"},
            {"from": "gpt", "value": "5 6"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Say something about the sea."},
            {"from": "gpt", "value": "It is wide."},
        ]
    },
]


def test_a_draft_measures_the_same_on_the_kimi_wrapper_as_on_its_language_model(
    tiny_kimi_k25, tiny_deepseek_v3, tmp_path
):
    kimi = with_vision_tower(with_remote_code(tiny_kimi_k25, tmp_path / "code"), tmp_path / "kimi")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    draft = tmp_path / "draft"
    logit_lens_draft(str(kimi), "KimiK25ForConditionalGeneration").save_pretrained(draft)
    reports = {}
    for name, verifier in (("kimi", kimi), ("deepseek", tiny_deepseek_v3)):
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(
            app,
            [
                "eval",
                "--draft",
                str(draft),
                "--verifier",
                str(verifier),
                "--data-path",
                str(data),
                "--max-new-tokens",
                "12",
                "--ignore-eos",
                "--engine",
                "hf",
                "--output-json",
                str(out),
                "--no-progress",
            ],
        )
        assert result.exit_code == 0, result.output
        reports[name] = json.loads(out.read_text())["drafts"][0]
    kimi_row, plain_row = reports["kimi"], reports["deepseek"]
    assert kimi_row["generated_tokens"] == 3 * 12 and kimi_row["acceptance_length"] > 1.0
    for key in (
        "acceptance_length",
        "num_drafts",
        "num_accepted_tokens",
        "per_position_acceptance_rate",
    ):
        assert kimi_row[key] == plain_row[key], key

    # The real folder's tokenizer is its own code (tiktoken): refused in one line, naming the flag.
    tokenizer_config = json.loads((kimi / "tokenizer_config.json").read_text())
    tokenizer_config.update(
        tokenizer_class="TikTokenTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    )
    (kimi / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    result = CliRunner().invoke(
        app, ["eval", "--draft", str(draft), "--data-path", str(data), "--engine", "hf"]
    )
    assert result.exit_code == 2
    assert (
        "needs the Python code shipped in its folder; pass --trust-remote-code" in result.output
    ), result.output
