"""SIGTERM and Ctrl-C for a run that can stop where it resumes: the one home of that handling.

A scheduler's SIGTERM (SLURM preemption, `scancel`, systemd, `timeout`) or the user's first Ctrl-C
only sets a flag (`StopSignals.requested`); the run checks it where stopping loses nothing (the
trainer after a step, regeneration between chunks) and stops there with `RunStopped`. Inside
`StopSignals.abandoning()` the signal also raises `StopSignalled` at once: work whose result is
only ever kept whole (a chunk of responses from an engine) is given up rather than finished. A
second Ctrl-C meets Python's own handler again and stops at once (KeyboardInterrupt).

The handlers are installed for a block only (`StopSignals.installed`) and the earlier ones put
back after it: a library caller keeps its own.

Helper processes that must not die of a signal sent to the whole process group ignore it
(`ignore_stop_signals`) and are started with the signals held back (`stop_signals_held`) so that
none arrives before they do. Worker pools a library forks without a hook for that (datasets'
`map(num_proc=N)`) run inside `ctrl_c_left_to_this_process()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from speculators_vllm016.utils.errors import RunStopped

__all__ = [
    "STOP_SIGNALS",
    "StopSignalled",
    "StopSignals",
    "ctrl_c_left_to_this_process",
    "ignore_stop_signals",
    "stop_signals_held",
]

logger = logging.getLogger("speculators")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignalled(BaseException):
    """Raised inside `StopSignals.abandoning()` by a stop signal. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way (one row's failure, an engine's
    retry) takes it for an error of its own."""


def ignore_stop_signals(*_: object) -> None:
    """In a helper process (a loader worker; usable as `worker_init_fn`): SIGTERM and Ctrl-C
    sent to the process group are the main process's to act on, not this process's."""
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


@contextlib.contextmanager
def ctrl_c_left_to_this_process() -> Iterator[None]:
    """For a block in which a library forks a worker pool it offers no start-up hook for (datasets'
    `map(num_proc=N)`): Ctrl-C to the process group raises KeyboardInterrupt in this process as
    usual, while the forked workers, which inherit the handler, let it pass; this process ends the
    pool, and no worker prints a traceback of its own. Only over Python's own Ctrl-C handler and
    in the main thread; otherwise the block runs as it is."""
    owner = os.getpid()

    def interrupt_owner_only(signum: int, frame: FrameType | None) -> None:
        if os.getpid() == owner:
            raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, interrupt_owner_only)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class StopSignals:
    """The stop flag, and the handlers that set it while `installed()` is active.

    `doing`: what the run does now that a stop was asked, for the warning line the signal logs.
    `signals`: the ones handled (a run that leaves Ctrl-C to Python's KeyboardInterrupt names
    SIGTERM only).
    """

    def __init__(
        self,
        doing: str,
        second_ctrl_c: str = "Ctrl-C again stops at once",
        signals: tuple[int, ...] = STOP_SIGNALS,
    ) -> None:
        self.doing, self.second_ctrl_c, self.signals = doing, second_ctrl_c, signals
        self.requested = False
        self.reason = "a stop signal"
        self.signum: int = signal.SIGTERM
        self._abandoning = False
        # Processes forked from this one inherit the handlers; there they do nothing (the
        # terminal's Ctrl-C reaches them too): the process that installed them stops them.
        self.handler_pid = os.getpid()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.handler_pid:
            return
        name, hint = "SIGTERM", ""
        if signum == signal.SIGINT:
            name, hint = "Ctrl-C", f" ({self.second_ctrl_c})"
            signal.signal(signal.SIGINT, signal.default_int_handler)
        logger.warning("%s: %s%s", name, self.doing, hint)
        self.requested, self.reason, self.signum = True, name, signum
        if self._abandoning:
            self._abandoning = False  # raised once; the stop itself is the caller's to make
            raise StopSignalled(name)

    def stopped(self, message: str) -> RunStopped:
        """The error that ends the run: "<signal>: message", with the signal's exit status."""
        return RunStopped(f"{self.reason}: {message}", signum=self.signum)

    def install(self) -> dict[int, Any]:
        """Handle SIGTERM, and Ctrl-C where Python's default handler has it (not where the shell
        made the process ignore it); returns the handlers replaced, for `restore`."""
        replaced: dict[int, Any] = {}
        self.handler_pid = os.getpid()
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            if signal.SIGTERM in self.signals:
                replaced[signal.SIGTERM] = signal.signal(signal.SIGTERM, self.on_signal)
            sigint = signal.getsignal(signal.SIGINT)
            if signal.SIGINT in self.signals and sigint is signal.default_int_handler:
                replaced[signal.SIGINT] = signal.signal(signal.SIGINT, self.on_signal)
        return replaced

    @staticmethod
    def restore(replaced: dict[int, Any]) -> None:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)

    @contextlib.contextmanager
    def installed(self, enabled: bool = True) -> Iterator[StopSignals]:
        """The handlers for the duration of the block (none when not `enabled`)."""
        replaced = self.install() if enabled else {}
        try:
            yield self
        finally:
            self.restore(replaced)

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[None]:
        """A stop signal inside the block raises `StopSignalled` there (a stop asked before the
        block raises it at its start): the block's work is given up, not finished."""
        if self.requested:
            raise StopSignalled(self.reason)
        self._abandoning = True
        try:
            yield
        finally:
            self._abandoning = False
