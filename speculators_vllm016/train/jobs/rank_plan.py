"""This process's part in a training job: which rank it is, where it trains, what it joined.

A plain or torchrun job joins the default process group (`maybe_setup_distributed`); a split online
job (`--extraction-ranks`) joins the split groups, where an extraction rank serves samples and
trains nothing. `join_ranks` does either and returns the training rank's `RankPlan`.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from speculators_vllm016.train.jobs.job_config import TrainJobConfig
from speculators_vllm016.train.jobs.setup import TrainSetup
from speculators_vllm016.train.logger import setup_root_logger
from speculators_vllm016.train.online.rank_layout import RankLayout
from speculators_vllm016.train.online.sample_transport import Transport
from speculators_vllm016.train.online.split import run_extraction_rank, split_layout
from speculators_vllm016.train.online.split_groups import join_split_groups
from speculators_vllm016.train.utils import maybe_setup_distributed
from speculators_vllm016.utils.command_errors import EXIT_STOPPED

__all__ = ["RankPlan", "StoppedExit", "join_ranks"]


@dataclass
class RankPlan:
    """A training rank of the job."""

    local_rank: int
    world_size: int
    """The training processes (a split job's extraction ranks not counted)."""
    rank: int
    """This process among the training processes."""
    distributed: bool
    device_name: str | None
    """Where it trains (`--device`, `--train-devices`' share, a split layout's device), or None."""
    layout: RankLayout | None = None
    """A split online job's layout (`--extraction-ranks`), else None."""
    transport: Transport | None = None
    """A split job's channel to the extraction ranks, else None."""
    stopped_exit: StoppedExit | None = None
    """A split job's SIGTERM handler (installed), else None."""


def join_ranks(config: TrainJobConfig, setup: TrainSetup) -> RankPlan | None:
    """Join the job's process groups; None on an extraction rank, after it served the run."""
    device_name = config.runtime.device
    online = setup.online
    if online is not None and online.devices is not None:
        device_name = online.devices.for_rank(int(os.environ.get("LOCAL_RANK", "0")))
    layout = split_layout(config)  # --extraction-ranks: this rank extracts or trains, not both
    if layout is None:
        local_rank, world_size, rank, distributed = maybe_setup_distributed(device_name)
        return RankPlan(local_rank, world_size, rank, distributed, device_name)
    groups = join_split_groups(layout)
    if layout.extracts:
        setup_root_logger("INFO", ranks="every")
        if setup.verifier is not None:  # it builds no draft: the verifier tensors read go
            setup.verifier.release_tensors()
        run_extraction_rank(config, setup, layout, groups)
        return None
    transport = groups.transport()
    return RankPlan(
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=layout.training_world_size,
        rank=layout.training_rank,
        distributed=True,
        device_name=layout.training_device,
        layout=layout,
        transport=transport,
        stopped_exit=StoppedExit.install(),
    )


class StoppedExit:
    """A split run's training rank: SIGTERM ends it with status 143 and a `stopped:` line.

    torchrun stops every other rank as soon as one exits. When an extraction rank fails, all
    training ranks checkpoint and exit 143 at about the same time; one that is still closing when
    torchrun's SIGTERM comes must end the same way, not be killed by the signal. The trainer
    installs its own handler while it trains and puts this one back after."""

    def __init__(self) -> None:
        self.reason = "SIGTERM"
        self.stopping = False  # the trainer stopped with a checkpoint: the job ends with 143

    @classmethod
    def install(cls) -> StoppedExit:
        handler = cls()
        signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, *_: Any) -> None:
        sys.stderr.write(f"stopped: {self.reason}\n")
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)
