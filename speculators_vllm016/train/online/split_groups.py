"""The process groups of a split online run (`--extraction-ranks K` under torchrun).

Two groups over torchrun's own store (its `env://` rendezvous):

- the training ranks' default group (NCCL on GPUs, else gloo): the trainer, FSDP2/DDP and every
  collective see only the training ranks, exactly as in a plain torchrun run of that size;
- an exchange group of every rank (gloo), for the requests and the samples between extraction and
  training ranks. It is a group object of its own, so its point-to-point traffic never mixes with
  the trainer's collectives;
- where every rank has a GPU, a payload group of every rank (NCCL) for the hidden states: an
  extraction rank stages them on its engine's first GPU, a training rank receives them on its own.

Each group lives under its own key prefix in the store, so they never read each other's keys.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from speculators_vllm016.train.online.rank_layout import RankLayout

__all__ = ["SplitGroups", "join_split_groups"]

logger = logging.getLogger(__name__)

EXCHANGE_PREFIX = "speculators/exchange"
PAYLOAD_PREFIX = "speculators/payload"
TRAINING_PREFIX = "speculators/training"


@dataclass
class SplitGroups:
    layout: RankLayout
    exchange: Any
    """`ProcessGroupGloo` of every rank (global ranks): requests and samples."""
    payload: Any = None
    """`ProcessGroupNCCL` of every rank for the hidden states when all have GPUs, else None."""
    payload_device: torch.device | None = None
    """This rank's GPU for the payload group."""

    def transport(self) -> Any:
        from speculators_vllm016.train.online.sample_transport import Transport

        return Transport(self.exchange, self.payload, self.payload_device)


def payload_device_of(layout: RankLayout) -> torch.device | None:
    """The GPU this rank sends or receives hidden states on, None on the CPU: a training rank's
    own, an extraction rank's engine's first (the node's GPU index)."""
    if layout.extracts:
        return torch.device("cuda", layout.engine_devices[0]) if layout.engine_devices else None
    device = torch.device(layout.training_device or "cpu")
    return device if device.type == "cuda" else None


def _torchrun_store(timeout: datetime.timedelta) -> Any:
    """The store torchrun's processes share (what `init_process_group("env://")` would use)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return store


def join_split_groups(layout: RankLayout, timeout_minutes: float = 30.0) -> SplitGroups:
    """Join the exchange group (every rank) and, on a training rank, the training ranks' default
    process group. Every rank of the run must call this."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = _torchrun_store(timeout)
    exchange = dist.ProcessGroupGloo(
        dist.PrefixStore(EXCHANGE_PREFIX, store), layout.rank, layout.world_size, timeout
    )
    payload, payload_device = None, payload_device_of(layout)
    # Every rank must make the same choice: on GPUs every rank has a payload device (a layout on
    # GPUs gives each extraction rank TP x PP >= 1 GPUs and each training rank one).
    if payload_device is not None:
        torch.cuda.set_device(payload_device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        payload = dist.ProcessGroupNCCL(
            dist.PrefixStore(PAYLOAD_PREFIX, store), layout.rank, layout.world_size, options
        )
    if not layout.extracts and not dist.is_initialized():
        device = torch.device(layout.training_device or "cpu")
        training_store = dist.PrefixStore(TRAINING_PREFIX, store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl",
                store=training_store,
                rank=layout.training_rank,
                world_size=layout.training_world_size,
                device_id=device,
                timeout=timeout,
            )
        else:
            dist.init_process_group(
                "gloo",
                store=training_store,
                rank=layout.training_rank,
                world_size=layout.training_world_size,
                timeout=timeout,
            )
    logger.info("%s (world of %s)", layout.describe(), os.environ.get("WORLD_SIZE"))
    return SplitGroups(
        layout=layout, exchange=exchange, payload=payload, payload_device=payload_device
    )
