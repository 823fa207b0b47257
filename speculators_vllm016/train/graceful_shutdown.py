"""Stop training cleanly on SIGTERM or a first Ctrl-C: finish the step, write a checkpoint, stop.

A scheduler's SIGTERM (or the user's Ctrl-C) only sets a flag (`utils.stop_signals`, the one home
of that handling); the trainer checks it after each step, on every rank at once
(`requested_on_any_rank`), so all ranks stop at the same step and write one checkpoint together.
A second Ctrl-C meets Python's own handler again and stops at once (KeyboardInterrupt), without
a checkpoint.

A scheduler (SLURM preemption, `scancel`, systemd, `timeout`) signals the whole process group:
the trainer's helper processes (loader workers, which also fill the row slots) get the same
SIGTERM. They ignore it (`utils.stop_signals.ignore_stop_signals`, their `worker_init_fn`) and
are started with the signals held back (`stop_signals_held`) so that none arrives before they
ignore it: a worker that died of it would crash the trainer before it could checkpoint. The
trainer ends them itself, and a worker whose parent is gone exits on its own (torch's watchdog).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from speculators_vllm016.utils.stop_signals import StopSignals

__all__ = ["GracefulShutdown"]


class GracefulShutdown(StopSignals):
    """The trainer's stop flag: set by a signal here or (`requested_on_any_rank`) on any rank."""

    def __init__(self) -> None:
        super().__init__(
            doing="finishing this step, then writing a checkpoint",
            second_ctrl_c="Ctrl-C again stops at once, without one",
        )
        self.reason = "a stop signal on another rank"

    def requested_on_any_rank(self, distributed: bool, device: torch.device) -> bool:
        """Whether any rank received a stop signal (every rank gets the same answer: one
        collective on `device`, which must suit the process group's backend)."""
        if not distributed:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
