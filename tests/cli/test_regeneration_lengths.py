"""The defaults of --max-prompt-tokens and --max-tokens fit the model's context (#50 item 8): the
documented `regenerate` command failed on a 2,048-token model (4096 + 2048 tokens of context)."""

from __future__ import annotations

import json
import logging

import pytest

from speculators_vllm016.cli import datagen as datagen_cli
from speculators_vllm016.cli import regenerate as regenerate_cli


@pytest.fixture
def model_2048(tmp_path):
    """Only what the flags read: a config.json with a 2,048-token context."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "max_position_embeddings": 2048, "hidden_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _regenerate(model, *extra: str):
    argv = ["--target-model-path", str(model), "--train-data-path", "x.jsonl"]
    args = regenerate_cli.build_parser().parse_args([*argv, "--output-dir", "out", *extra])
    options = regenerate_cli.regenerate_options_from_args(args)
    return options.max_prompt_tokens, options.sampling.max_tokens


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ((), (1024, 1024)),
        (("--max-tokens", "16"), (2032, 16)),
        (("--max-prompt-tokens", "400"), (400, 1648)),
        (("--max-model-len", "1000"), (500, 500)),
        (("--max-tokens", "16", "--max-prompt-tokens", "4000"), (4000, 16)),  # given: refused later
    ],
)
def test_defaults_are_lowered_to_the_models_context(model_2048, caplog, extra, expected):
    with caplog.at_level(logging.INFO):
        assert _regenerate(model_2048, *extra) == expected
    said = [r.getMessage() for r in caplog.records if "lowered from the default" in r.getMessage()]
    assert len(said) == (0 if len(extra) == 4 else 1), said


def test_a_long_context_keeps_the_defaults(model_2048, caplog):
    config = json.loads((model_2048 / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (model_2048 / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO):
        assert _regenerate(model_2048) == (4096, 2048)
    assert "lowered" not in caplog.text


def test_datagen_regenerate_fits_them_the_same_way(model_2048):
    argv = ["--target-model-path", str(model_2048), "--train-data-path", "x.jsonl"]
    args = datagen_cli.build_parser().parse_args([*argv, "--output-dir", "out", "--regenerate"])
    options = datagen_cli.regeneration_options(args)
    assert (options.max_prompt_tokens, options.sampling.max_tokens) == (1024, 1024)
