"""The training job's modules import no vLLM: a job trains where vLLM is not installed (offline
data), and its online parts import the engine only when they start one."""

from __future__ import annotations

import subprocess
import sys

JOB_MODULES = ["job", "loaders", "rank_plan", "draft_build", "setup"]


def test_the_job_imports_no_vllm():
    code = (
        "import sys\n"
        + "".join(f"import speculators_vllm016.train.jobs.{m}\n" for m in JOB_MODULES)
        + "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad[:5]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
