"""How the trainer benchmarks start a training run and tend it while it goes.

Both `trainer_gpu.py` (our trainer) and `trainer_030.py` (0.3.0's) launch `torchrun` groups the
same way: with NVLink multicast off, in a session of their own that a timeout kills whole, and
optionally with old checkpoints deleted as new ones appear. Stdlib only, so that 0.3.0's launcher
may import it before 0.3.0's script runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SAFE_ENV", "checkpoint_pruning", "run_process_group"]

# Keep NVLink multicast off everywhere (it can take a shared host's GPUs out of service).
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def run_process_group(
    command: list[str], env: dict[str, str], log: Path, timeout: float, cwd: Path | None = None
) -> tuple[int | None, str | None]:
    """Run `command` (output to `log`) in its own session: `(returncode, None)`, or
    `(None, "timed out ...")` after killing the whole group. Killing torchrun alone would leave
    its workers holding the GPUs under the next run."""
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
        try:
            return process.wait(timeout=timeout), None
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None, f"timed out after {timeout} s"


@contextlib.contextmanager
def checkpoint_pruning(save: Path, keep: int | None) -> Iterator[None]:
    """While the block runs, delete all but the newest `keep` finished checkpoints in `save` (a
    Kimi-sized draft's checkpoint is ~20 GB: three epochs' would not fit the GPU machine's disk).
    A checkpoint folder appears whole (written aside, then renamed), so a listed one is done."""
    if not keep:
        yield
        return
    stop = threading.Event()

    def prune() -> None:
        while not stop.wait(1.0):
            done = [
                f
                for f in save.glob("*")
                if f.is_dir() and not f.is_symlink() and (f / "model.safetensors").is_file()
            ]
            for folder in sorted(done, key=lambda f: f.stat().st_mtime)[:-keep]:
                shutil.rmtree(folder, ignore_errors=True)

    thread = threading.Thread(target=prune, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
