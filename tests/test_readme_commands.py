"""The tutorial's section "From a chat dataset to a draft served by vLLM" runs as written, in order.

The commands are read from the tutorial page itself (docs/tutorial.md, which the README links as
its tutorial): every ```bash block of the section, backslash continuations joined and comments
dropped (`shlex`). They run in a temporary folder (so the page's relative paths, `llama8b/...`,
land there) after two kinds of substitution, and no other change:

- PLACEHOLDERS: what the page names but a test cannot fetch (offline): the Llama model becomes a
  tiny Llama built here, the chat data (`sharegpt`, `heldout.jsonl`) the shipped demo
  conversations;
- SCALED_DOWN: the sizes of an 8B model on a GPU, per (flag, page value), made tiny so the
  commands run on a CPU in minutes (a 64-token draft vocabulary of the tiny 512-token target).

`speculators` is run as `python -m speculators_vllm016`. Commands that cannot run here are skipped
only by the rules in SKIPPED (each says why and what is still checked), never silently: a command
matched by no rule runs and must exit 0.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training_fixtures import cli_env

REPO = Path(__file__).resolve().parents[1]

TUTORIAL = REPO / "docs" / "tutorial.md"
SECTION = "## From a chat dataset to a draft served by vLLM"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
CHAT_DATA = ("sharegpt", "heldout.jsonl")
SCALED_DOWN = {
    ("--max-samples", "50000"): "24",
    ("--seq-length", "2048"): "128",
    ("--draft-vocab-size", "32000"): "64",
    ("--epochs", "10"): "1",  # the page's commands run as written; one epoch is enough for that
    ("--max-prompts", "200"): "2",
}
# (rule, why): a command skipped by a rule is listed in the test's output.
SKIPPED = {
    "vllm serve": "serving a speculative draft needs vLLM's GPU build (the CPU build refuses "
    "speculative decoding) and runs until stopped; the draft folder it names is "
    "checked to exist",
}


def section_commands(page: str, section: str = SECTION) -> list[list[list[str]]]:
    """The argv of each command, block by block, as the page writes them under `section`."""
    start = page.index(section)
    end = page.find("\n## ", start + len(section))
    text = page[start : end if end != -1 else None]
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert blocks, f"no bash block under {section!r}"
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n", " ", block)
        commands.append(
            [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]
        )
    return commands


def substituted(argv: list[str], target: Path, chats: Path) -> list[str]:
    out = []
    for i, token in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if token == LLAMA:
            token = str(target)
        elif token in CHAT_DATA:
            token = str(chats)
        elif (flag, token) in SCALED_DOWN:
            token = SCALED_DOWN[(flag, token)]
        out.append(token)
    if out[0] == "speculators":
        return [sys.executable, "-m", "speculators_vllm016", *out[1:]]
    return out


def skip_rule(argv: list[str]) -> str | None:
    if argv[:2] == ["vllm", "serve"]:
        return "vllm serve"
    return None


def test_the_section_parses_into_the_expected_commands():
    """Fast guard for the extraction itself: the tutorial's steps are found, in order (the
    Kimi-K2.5 block lives on its own page, run by tests/test_kimi_k25_recipe.py)."""
    blocks = section_commands(TUTORIAL.read_text(encoding="utf-8"))
    llama = [argv[:2] for argv in blocks[0]]
    assert llama == [
        ["speculators", "datagen"],
        ["speculators", "vocab-mapping"],
        ["speculators", "train"],
        ["speculators", "eval"],
        ["vllm", "serve"],
    ]
    assert len(blocks) == 1


@pytest.fixture(scope="module")
def readme_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with 8 layers: datagen's default layer ids [2, 4, 5, 7] are distinct (the
    shared 4-layer one needs --layer-ids, which the tutorial does not give)."""
    from speculators_vllm016.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("readme") / "llama8", num_hidden_layers=8)


@pytest.mark.engine
@pytest.mark.slow
def test_the_readme_pipeline_runs_as_written(readme_target, tmp_path):
    from speculators_vllm016.demo import demo_conversations_path

    blocks = section_commands(TUTORIAL.read_text(encoding="utf-8"))
    ran, skipped = [], []
    for block in blocks:
        for argv in block:
            rule = skip_rule(argv)
            if rule is not None:
                skipped.append((rule, " ".join(argv[:3])))
                if rule == "vllm serve":
                    spec = json.loads(argv[argv.index("--speculative-config") + 1])
                    assert (tmp_path / spec["model"] / "config.json").is_file(), spec
                continue
            command = substituted(argv, readme_target, demo_conversations_path())
            env = cli_env()
            env["PYTHONPATH"] = (
                str(REPO) + os.pathsep + env["PYTHONPATH"]
            )  # this checkout's package
            done = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
            )
            assert done.returncode == 0, (
                f"tutorial command failed: {' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
            ran.append(" ".join(argv[:2]))
    print("ran:", ran, "\nskipped by rule:", skipped)
    assert ran == [
        "speculators datagen",
        "speculators vocab-mapping",
        "speculators train",
        "speculators eval",
    ]
    assert {rule for rule, _ in skipped} == set(SKIPPED)
