"""The process groups of a split online run (`--extraction-ranks K` under torchrun).

Two groups over torchrun's own store (its `env://` rendezvous):

- the training ranks' default group (NCCL on GPUs, else gloo): the trainer, FSDP2/DDP and every
  collective see only the training ranks, exactly as in a plain torchrun run of that size;
- an exchange group of every rank (gloo), for the requests and the samples between extraction and
  training ranks. It is a group object of its own, so its point-to-point traffic never mixes with
  the trainer's collectives.

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

from speculators_vllm016.train.rank_layout import RankLayout

__all__ = ["SplitGroups", "join_split_groups"]

logger = logging.getLogger(__name__)

EXCHANGE_PREFIX = "speculators/exchange"
TRAINING_PREFIX = "speculators/training"


@dataclass
class SplitGroups:
    layout: RankLayout
    exchange: Any
    """`ProcessGroupGloo` of every rank (global ranks): requests and samples."""


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
    if not layout.extracts and not dist.is_initialized():
        device = torch.device(layout.training_device or "cpu")
        training_store = dist.PrefixStore(TRAINING_PREFIX, store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl", store=training_store, rank=layout.training_rank,
                world_size=layout.training_world_size, device_id=device, timeout=timeout,
            )
        else:
            dist.init_process_group(
                "gloo", store=training_store, rank=layout.training_rank,
                world_size=layout.training_world_size, timeout=timeout,
            )
    logger.info("%s (world of %s)", layout.describe(), os.environ.get("WORLD_SIZE"))
    return SplitGroups(layout=layout, exchange=exchange)
