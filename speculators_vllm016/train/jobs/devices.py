"""`--train-devices`: which devices the draft trains on, and which are left to the target's engine.

Online training runs the target model's engine and the draft's trainer on one machine. By default
they time-share the same devices. `--train-devices cuda:7` (or `cuda:6,cuda:7`, one per training
process) gives those GPUs to the trainer and every other visible GPU to the engine: the engine's
worker processes are started with `CUDA_VISIBLE_DEVICES` naming only those, while the trainer's
own process keeps its view (its CUDA context exists before the engine starts, so the variable is
set only for the engine's start and restored afterwards). `cpu` trains on the CPU.

GPU numbers are those of the trainer's own view: under `CUDA_VISIBLE_DEVICES=2,3,4` `cuda:0` is
physical GPU 2, and the engine gets `3,4`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "TrainDevices",
    "TrainDevicesError",
    "engine_visible_devices",
    "launcher_variables_hidden",
    "parse_train_devices",
    "visible_gpus",
]

FLAG = "--train-devices"
_CUDA = re.compile(r"cuda:(\d+)")


class TrainDevicesError(InvalidInputError):
    """A `--train-devices` value that cannot work; the message names the flag and the fix."""


@dataclass(frozen=True)
class TrainDevices:
    """The trainer's devices (one per process on this node, or `cpu` for all) and the engine's."""

    trainer: tuple[str, ...]
    engine_visible: str | None  # CUDA_VISIBLE_DEVICES for the engine; None: leave it as it is

    def for_rank(self, local_rank: int) -> str:
        """The device the process of this local rank trains on."""
        return self.trainer[0] if len(self.trainer) == 1 else self.trainer[local_rank]


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as `CUDA_VISIBLE_DEVICES` entries (physical ids or UUIDs)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(index) for index in range(count)]
    entries = [entry.strip() for entry in listed.split(",") if entry.strip()]
    return entries[:count]


def parse_train_devices(
    text: str, *, visible: list[str], local_processes: int = 1, engine_gpus_needed: int = 1
) -> TrainDevices:
    """Check `text` against the visible GPUs and the number of training processes on this node."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise TrainDevicesError(
            f"{FLAG} {text!r} is empty or has an empty entry; give cpu or cuda:N[,cuda:M...]"
        )
    if "cpu" in items:
        if items != ["cpu"]:
            raise TrainDevicesError(f"{FLAG} {text!r} mixes cpu with other devices; give cpu alone")
        return TrainDevices(trainer=("cpu",), engine_visible=None)
    indices = []
    for item in items:
        match = _CUDA.fullmatch(item)
        if match is None:
            raise TrainDevicesError(
                f"{FLAG}: {item!r} is not a device; give cpu or cuda:N[,cuda:M...]"
            )
        indices.append(int(match.group(1)))
    if len(set(indices)) != len(indices):
        raise TrainDevicesError(
            f"{FLAG} {text!r} names a GPU twice; give each training process its own"
        )
    if not visible:
        raise TrainDevicesError(f"{FLAG} {text!r}: no CUDA GPU is visible here; give cpu")
    for index in indices:
        if index >= len(visible):
            raise TrainDevicesError(
                f"{FLAG}: cuda:{index} does not exist ({len(visible)} GPUs visible: cuda:0 to "
                f"cuda:{len(visible) - 1})"
            )
    if len(indices) != local_processes:
        raise TrainDevicesError(
            f"{FLAG} names {len(indices)} GPUs for {local_processes} training processes on this "
            "node; give one per process (torchrun --nproc-per-node)"
        )
    rest = [gpu for position, gpu in enumerate(visible) if position not in indices]
    if len(rest) < engine_gpus_needed:
        raise TrainDevicesError(
            f"{FLAG} {text!r} leaves {len(rest)} of {len(visible)} GPUs for the target model's "
            f"engine, which needs {engine_gpus_needed} (--tensor-parallel-size x "
            "--pipeline-parallel-size); give the trainer fewer, or drop the flag to share devices"
        )
    return TrainDevices(
        trainer=tuple(f"cuda:{index}" for index in indices), engine_visible=",".join(rest)
    )


@contextlib.contextmanager
def engine_visible_devices(value: str | None) -> Iterator[None]:
    """`CUDA_VISIBLE_DEVICES=value` while the engine (and its worker processes) start."""
    if value is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


# Set by torchrun for the training processes; the engine's workers must not see them.
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@contextlib.contextmanager
def launcher_variables_hidden() -> Iterator[None]:
    """torchrun's variables removed while the engine (and its worker processes) start.

    With `TORCHELASTIC_USE_AGENT_STORE` set, torch makes every `init_process_group` a client of
    torchrun's store, so the engine worker's own one-process group (tcp://127.0.0.1:<port>) waits
    forever for a server nobody starts.
    """
    names = [
        name
        for name in os.environ
        if name in _LAUNCHER_VARIABLES or name.startswith("TORCHELASTIC_")
    ]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        yield
    finally:
        os.environ.update(saved)
