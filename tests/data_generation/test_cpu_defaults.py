"""CPU-build environment defaults (pure logic on os.environ) and the slow-bf16 warning."""

from __future__ import annotations

import os

import pytest
import torch

from speculators_vllm016.data_generation import cpu_defaults
from speculators_vllm016.data_generation.cpu_defaults import (
    cpu_vector_flags,
    slow_cpu_dtype_warning,
)

NAMES = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_MLA_DISABLE")


@pytest.fixture
def clean_env(monkeypatch):
    saved = {name: os.environ.get(name) for name in NAMES}
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_defaults.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    yield
    # apply_cpu_defaults writes os.environ directly: put back exactly what was there.
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_defaults_for_tensor_parallel_deepseek(clean_env):
    chosen = cpu_defaults.apply_cpu_defaults(2, {"text_config": {"kv_lora_rank": 512}})
    assert chosen["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert chosen["VLLM_MLA_DISABLE"] == "1"
    assert int(chosen["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    assert all(os.environ[name] == value for name, value in chosen.items())


def test_user_values_are_kept(clean_env, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    chosen = cpu_defaults.apply_cpu_defaults(1, {"num_hidden_layers": 2})
    assert chosen == {}
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_too_few_cpus_for_the_workers(clean_env):
    with pytest.raises(ValueError, match="8 CPU workers need at least 8 CPUs"):
        cpu_defaults.apply_cpu_defaults(8, {})


def test_defaults_are_removed_after_the_engine_started(clean_env):
    with cpu_defaults.cpu_defaults_applied(2, {}) as chosen:
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == chosen["VLLM_CPU_OMP_THREADS_BIND"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ


def test_bf16_on_a_cpu_without_avx512_gets_a_warning():
    amd_avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nmodel name\t: AMD EPYC\n"
    flags = cpu_vector_flags(amd_avx2)
    assert flags == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    warning = slow_cpu_dtype_warning(torch.bfloat16, flags)
    assert warning is not None and "--dtype float32" in warning
    assert slow_cpu_dtype_warning(torch.float32, flags) is None
    for fast in ("avx512f", "avx512_bf16", "amx_bf16"):
        assert slow_cpu_dtype_warning(torch.bfloat16, flags | {fast}) is None
    assert cpu_vector_flags("no flags line\n") is None
    assert slow_cpu_dtype_warning(torch.bfloat16, None) is None  # unknown CPU: no guess
