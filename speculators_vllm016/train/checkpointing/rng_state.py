"""Each rank's random number generators in a checkpoint: stored as tensors and plain values, read
back without running any code from the file.

A checkpoint's `rng_state_rank<r>.pt` holds Python's, NumPy's, torch's and (on GPUs) CUDA's
generator states. They are stored as tensors, numbers and strings only, so `torch.load` reads
them with `weights_only=True`: a file someone replaced with a pickle that calls a function is
refused, not run. Checkpoints written before this layout hold NumPy's state as an array; those
load too, allowing NumPy's array reconstruction and nothing else.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speculators_vllm016.train.checkpointing.checkpoint_files import weights_only_refusal
from speculators_vllm016.utils.errors import SpeculatorsError, first_line

__all__ = ["RngStateUnsafe", "capture_rng_state", "load_rng_state", "restore_rng_state"]

FORMAT = 2  # 1: 0.x checkpoints of this package (NumPy's state as an array, Python's as a tuple)


class RngStateUnsafe(SpeculatorsError, pickle.UnpicklingError):
    """The file needs code to load (it is not an RNG state this package writes)."""


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors and plain values."""
    version, internal, gauss_next = random.getstate()
    kind, key, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "format": FORMAT,
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators to `state` (this layout, or the earlier one)."""
    python, numpy_state = state["python"], state["numpy"]
    if isinstance(python, dict):
        internal = tuple(int(value) for value in python["state"].tolist())
        random.setstate((python["version"], internal, python["gauss_next"]))
    else:
        random.setstate(python)
    if isinstance(numpy_state, dict):
        key = numpy_state["key"].numpy().astype(np.uint32)
        np.random.set_state(
            (
                numpy_state["kind"],
                key,
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    else:
        np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What unpickling a NumPy array needs: its reconstruction, its class and its dtype."""
    core = getattr(np, "_core", None) or np.core
    dtypes = [type(np.dtype(np.uint32)), type(np.dtype(np.float64))]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *dtypes]


def load_rng_state(path: Path) -> dict[str, Any]:
    """Read an RNG state file without running code from it.

    Raises `RngStateUnsafe` for a file that would need any other code to load; the damage of a
    cut file surfaces as torch's own error.
    """
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise RngStateUnsafe(weights_only_refusal(error) or first_line(error)) from None
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise RngStateUnsafe("it does not hold the python, numpy and torch generator states")
    return state
