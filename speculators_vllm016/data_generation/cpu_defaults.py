"""Environment defaults that let vLLM's CPU build start with nothing set by the user.

vLLM reads these variables when the engine config is made and when workers start, so they are set
in this process for exactly that span (workers inherit them) and taken away afterwards, so that
one engine's choice (say, a tensor-parallel thread binding) never leaks into the next. A value
the user set is never changed. Each default applied is reported so the caller can log it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.text_config import text_config_of

__all__ = [
    "apply_cpu_defaults",
    "cpu_defaults_applied",
    "cpu_vector_flags",
    "is_cpu_platform",
    "slow_cpu_dtype_warning",
    "uses_mla",
]

_GIB = 1024**3


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def uses_mla(config_dict: dict) -> bool:
    """True for DeepSeek-V2/V3-style attention (Kimi-K2 and K2.5 too), possibly nested."""
    return bool(text_config_of(config_dict).get("kv_lora_rank"))


def _thread_binding(world_size: int) -> str:
    """Split the CPUs this process may use into one contiguous group per worker."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < world_size:
        raise InvalidInputError(
            f"{world_size} CPU workers need at least {world_size} CPUs; this process has "
            f"{len(cpus)}. Set VLLM_CPU_OMP_THREADS_BIND yourself to oversubscribe."
        )
    per_worker = len(cpus) // world_size
    groups = [cpus[i * per_worker : (i + 1) * per_worker] for i in range(world_size)]
    return "|".join(",".join(str(cpu) for cpu in group) for group in groups)


def apply_cpu_defaults(world_size: int, config_dict: dict) -> dict[str, str]:
    """Set sane CPU-build defaults for unset variables; return those that were set."""
    chosen: dict[str, str] = {}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        # vLLM's own default takes half the RAM per worker, which kills tensor-parallel runs.
        total_gib = psutil.virtual_memory().total / _GIB
        per_worker = max(1, min(8, int(total_gib * 0.1 / max(world_size, 1))))
        chosen["VLLM_CPU_KVCACHE_SPACE"] = str(per_worker)
    if world_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # "auto" binding asserts on machines with fewer NUMA nodes than workers.
        chosen["VLLM_CPU_OMP_THREADS_BIND"] = _thread_binding(world_size)
    if uses_mla(config_dict) and "VLLM_MLA_DISABLE" not in os.environ:
        # There is no MLA kernel on CPU; vLLM then runs plain attention on decompressed KV.
        chosen["VLLM_MLA_DISABLE"] = "1"
    os.environ.update(chosen)
    return chosen


@contextmanager
def cpu_defaults_applied(world_size: int, config_dict: dict) -> Iterator[dict[str, str]]:
    """`apply_cpu_defaults` for the duration of the block; the variables it set are removed after."""
    chosen = apply_cpu_defaults(world_size, config_dict)
    try:
        yield chosen
    finally:
        for name in chosen:
            os.environ.pop(name, None)


# Any of these lets bf16 matrix work run at about fp32 speed or better on x86 (AVX-512 converts
# bf16 in vector registers; AVX512-BF16 and AMX compute in it). Without them it is emulated.
FAST_BF16_FLAGS = frozenset({"avx512f", "avx512_bf16", "amx_bf16"})


def cpu_vector_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags (Linux's `/proc/cpuinfo`), None where they cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def slow_cpu_dtype_warning(dtype: torch.dtype, flags: frozenset[str] | None) -> str | None:
    """A warning when the engine will run bf16 on a CPU that can only emulate it, else None."""
    if dtype != torch.bfloat16 or flags is None or flags & FAST_BF16_FLAGS:
        return None
    return (
        "bfloat16 on this CPU is emulated (no AVX-512, AVX512-BF16 or AMX): expect it to run "
        "several times slower than --dtype float32 (about 5x in our extraction benchmark on "
        "such a CPU), which stores float32 hidden states (twice the disk)"
    )
