"""A checkpoint names its verifier resolved (an absolute folder, or the hub id as given), so
`eval` finds it from any working folder; a verifier that is not found asks for --verifier."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.cli.train import main as train_main
from tests.training_fixtures import train_args

CHAT = {
    "conversations": [{"from": "human", "value": "Hello there?"}, {"from": "gpt", "value": "Hi."}]
}


def test_a_relative_verifier_path_is_recorded_absolute_and_eval_runs_elsewhere(
    tiny_llama, training_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tiny_llama.parent)
    save = tmp_path / "ckpt"
    argv = train_args(tiny_llama, training_data, save, "--epochs", "1", "--max-steps", "1")
    argv[argv.index("--verifier-name-or-path") + 1] = tiny_llama.name  # as typed: relative
    assert train_main(argv) == 0
    checkpoint = save / "0-step1"
    recorded = json.loads((checkpoint / "config.json").read_text())["speculators_config"][
        "verifier"
    ]
    assert recorded["name_or_path"] == str(tiny_llama.resolve())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (elsewhere / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(checkpoint),
            "--data-path",
            "chat.jsonl",
            "--engine",
            "hf",
            "--max-prompts",
            "1",
            "--max-new-tokens",
            "4",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output

    moved = tmp_path / "moved"
    shutil.copytree(checkpoint, moved)
    config = json.loads((moved / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path / "gone" / "llama")
    (moved / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--draft",
            str(moved),
            "--data-path",
            "chat.jsonl",
            "--engine",
            "hf",
            "--max-prompts",
            "1",
            "--no-progress",
        ],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error: ")]
    assert (
        len(lines) == 1
        and "--verifier" in lines[0]
        and str(tmp_path / "gone" / "llama") in lines[0]
    ), result.output
