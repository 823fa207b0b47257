"""Stop training cleanly on SIGTERM or a first Ctrl-C: finish the step, write a checkpoint, stop.

A scheduler's SIGTERM (or the user's Ctrl-C) only sets a flag; the trainer checks it after each
step, on every rank at once (`requested_on_any_rank`), so all ranks stop at the same step and
write one checkpoint together. A second Ctrl-C meets Python's own handler again and stops at once
(KeyboardInterrupt), without a checkpoint.

A scheduler (SLURM preemption, `scancel`, systemd, `timeout`) signals the whole process group:
the trainer's helper processes (loader workers, which also fill the row slots) get the same
SIGTERM. They ignore it (`ignore_stop_signals`, their `worker_init_fn`) and are started with the
signals held back (`stop_signals_held`) so that none arrives before they ignore it: a worker that
died of it would crash the trainer before it could checkpoint. The trainer ends them itself, and
a worker whose parent is gone exits on its own (torch's watchdog).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "GracefulShutdown", "ignore_stop_signals", "stop_signals_held"]

logger = logging.getLogger("speculators")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(*_: object) -> None:
    """In a helper process (a loader worker; usable as `worker_init_fn`): SIGTERM and Ctrl-C
    sent to the process group are the trainer's to act on, not this process's."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held back by `stop_signals_held`


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT held back from this thread for the block: processes started in it
    inherit the held signals and receive none before `ignore_stop_signals` runs there. This
    process gets a signal that arrived meanwhile when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class GracefulShutdown:
    """The stop flag, and the handlers that set it while `installed()` is active."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = "a stop signal on another rank"
        # Loader processes forked from the trainer inherit the handlers; there they do nothing
        # (the terminal's Ctrl-C reaches them too): the trainer stops them when it is done.
        self.handler_pid = os.getpid()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.handler_pid:
            return
        name, hint = "SIGTERM", ""
        if signum == signal.SIGINT:
            name, hint = "Ctrl-C", " (Ctrl-C again stops at once, without one)"
            signal.signal(signal.SIGINT, signal.default_int_handler)
        logger.warning("%s: finishing this step, then writing a checkpoint%s", name, hint)
        self.requested, self.reason = True, name

    def install(self) -> dict[int, Any]:
        """Handle SIGTERM, and Ctrl-C where Python's default handler has it (not where the shell
        made the process ignore it); returns the handlers replaced, for `restore`."""
        replaced: dict[int, Any] = {}
        self.handler_pid = os.getpid()
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            replaced[signal.SIGTERM] = signal.signal(signal.SIGTERM, self.on_signal)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                replaced[signal.SIGINT] = signal.signal(signal.SIGINT, self.on_signal)
        return replaced

    @staticmethod
    def restore(replaced: dict[int, Any]) -> None:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)

    @contextlib.contextmanager
    def installed(self, enabled: bool = True) -> Iterator[None]:
        """The handlers for the duration of the block (none when not `enabled`)."""
        replaced = self.install() if enabled else {}
        try:
            yield
        finally:
            self.restore(replaced)

    def requested_on_any_rank(self, distributed: bool, device: torch.device) -> bool:
        """Whether any rank received a stop signal (every rank gets the same answer: one
        collective on `device`, which must suit the process group's backend)."""
        if not distributed:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
