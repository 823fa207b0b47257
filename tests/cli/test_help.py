"""#37 item 22: every command's `--help` is quick because it imports neither torch nor vLLM
(nor transformers): the parsers are built from light modules, the work's imports come after.
Checked on the modules a fresh interpreter loaded, never on a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMMANDS = [
    "train",
    "datagen",
    "regenerate",
    "eval",
    "convert",
    "vocab-mapping",
    "gen-and-train",
    "demo",
]
HEAVY = ("torch", "vllm", "transformers")

_PROBE = """
import json, sys
sys.argv = ["speculators", *json.loads(sys.argv[1])]
from speculators_vllm016.__main__ import app
try:
    app()
except SystemExit as stop:
    code = stop.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def _help(*argv: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(argv))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return json.loads(done.stderr.strip().splitlines()[-1]), done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_help_imports_neither_torch_nor_vllm(command):
    loaded, printed = _help(command, "--help")
    assert loaded["code"] in (0, None), loaded
    assert "--" in printed, printed  # the help itself was printed
    assert loaded["heavy"] == [], f"`speculators {command} --help` imported {loaded['heavy']}"


def test_the_top_level_help_imports_neither():
    loaded, printed = _help("--help")
    assert loaded["heavy"] == [] and "train" in printed


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_one_layout(command):
    """#37 item 22: argparse's help page for every command (the typer ones included), `-h` too."""
    from typer.testing import CliRunner

    from speculators_vllm016.__main__ import app

    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    page = result.output
    assert page.startswith(f"usage: speculators {command} [-h]"), page
    assert "\noptions:\n  -h, --help            show this help message and exit\n" in page, page
    assert "(default: " in page, page  # argparse's defaults formatter, as every command uses
    assert "Usage:" not in page and "╭" not in page, page  # no typer/rich page
    assert CliRunner().invoke(app, [command, "-h"]).output == page
