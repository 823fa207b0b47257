"""The CPU speculation patch's gates and checks, in fresh interpreters (no engine).

The probe (cpu_speculation_probe.py) imports vLLM 0.16's CPU build as installed: nothing may be
patched when switched off, on another vLLM version, or when any replaced function is not the one
the patch was written against (each such case names what broke); through vLLM's own plugin
loader the runner is patched and exactly the spec-decode kernels run by Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculators_vllm016.vllm_plugin.cpu_speculation import (
    CPU_SPECULATION_ENV,
    cpu_speculation_enabled,
)

PROBE = Path(__file__).with_name("cpu_speculation_probe.py")
REPO = Path(__file__).resolve().parents[2]


def probe(scenario: str, **env: str) -> dict:
    environ = dict(os.environ)
    environ.pop(CPU_SPECULATION_ENV, None)
    environ.pop("TRITON_INTERPRET", None)
    environ.update(env, PYTHONPATH=f"{REPO}{os.pathsep}{environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [sys.executable, str(PROBE), scenario],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE ") :])


@pytest.fixture(scope="module")
def seen() -> dict:
    return probe("refusals")


def test_switch_values():
    assert cpu_speculation_enabled({})
    assert cpu_speculation_enabled({CPU_SPECULATION_ENV: "1"})
    for off in ("0", "false", "No", " off "):
        assert not cpu_speculation_enabled({CPU_SPECULATION_ENV: off})


def test_switched_off_or_another_vllm_patches_nothing(seen):
    assert seen["switched_off"] == [None, False]
    line, patched, warnings = seen["other_version"]
    assert line is None and not patched
    assert len(warnings) == 1 and "written for vLLM 0.16.x, found 0.17.1" in warnings[0]


def test_a_broken_assumption_fails_loudly_naming_it_and_patches_nothing(seen):
    broken = seen["broken"]
    assert "GPUModelRunner._copy_draft_token_ids_to_cpu takes" in broken["copy_parameters"]
    assert "load_model neither loads the drafter" in broken["load_model"]
    assert "asserts there is no speculative config" in broken["init"]
    for message in broken.values():
        assert "this vLLM breaks the assumption" in message and CPU_SPECULATION_ENV in message
    assert not seen["patched_after_refusals"]
    assert seen["interpreted_before"] == []


def test_the_plugin_entry_point_patches_the_runner_and_only_the_spec_decode_kernels(seen):
    assert seen["patched"]
    assert "CPU speculative decoding enabled" in seen["line"]
    assert "7 Triton kernels" in seen["line"]
    assert seen["kernels"]["vllm.v1.sample.rejection_sampler"] == sorted(
        [
            "expand_kernel",
            "rejection_greedy_sample_kernel",
            "rejection_random_sample_kernel",
            "sample_recovered_tokens_kernel",
        ]
    )
    assert len(seen["kernels"]["vllm.v1.spec_decode.utils"]) == 3
    assert seen["taken_before_sees_interpreted"]  # modules imported before are re-executed
    assert seen["vllm_triton_is_placeholder"] == "TritonPlaceholder"  # the rest of vLLM as shipped
    assert seen["other_module_kernels"] == []
    assert seen["triton_interpret"] == "1"


def test_switching_the_plugin_off_switches_cpu_speculation_off():
    assert probe("plugin-off", SPECULATORS_VLLM_PLUGIN="0") == {"patched": False}
