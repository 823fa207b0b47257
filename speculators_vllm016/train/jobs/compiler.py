"""The compiler's start for a training job: its cache folder, and its workers started early.

A cold first step on a GPU spends most of its time compiling the draft's blocks (43.5 s on an
H100 for the Kimi-K2.5 draft at 8,192 tokens, 32 s of it building kernels). Two things here
shorten it:

- inductor compiles kernels in a pool of worker processes, which it starts when the first graph
  reaches it, and each worker imports torch first. Started at the job's start instead
  (`torch._inductor.async_compile.maybe_warm_pool`, what inductor itself calls), the workers
  come up while the verifier's weights load and the loaders start.
- `--compile-cache-dir`: torch's compile caches (inductor's graphs and kernels, Triton's
  binaries, the shapes seen dynamic) in a folder the user keeps, not in /tmp, so a resumed run
  on a fresh machine, or the next run of the same draft, finds its kernels built.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["compile_cache_environment", "start_compiler"]


def compile_cache_environment(folder: Path) -> dict[str, str]:
    """The environment that puts torch's compile caches (inductor's, and Triton's inside it)
    in `folder`."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}


def start_compiler(cache_dir: str | None, device_name: str | None) -> None:
    """Point torch's compile caches at `cache_dir` (when given) and, on a CUDA device, start
    inductor's compile workers now. Call before anything is compiled: the workers take the
    cache folder from the environment when they start."""
    if cache_dir is not None:
        folder = Path(cache_dir).expanduser().resolve()
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.update(compile_cache_environment(folder))
    import torch

    on_gpu = device_name.startswith("cuda") if device_name else torch.cuda.is_available()
    if not on_gpu:
        return  # the blocks are compiled on GPUs only
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
