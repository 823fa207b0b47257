"""The stop flag: SIGTERM or a first Ctrl-C set it (raising only inside `abandoning()`), the run's
exit status follows the signal, a second Ctrl-C stops at once, and the handlers go back after."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from speculators_vllm016.utils.command_errors import report_errors
from speculators_vllm016.utils.stop_signals import (
    StopSignalled,
    StopSignals,
    ctrl_c_left_to_this_process,
)


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode of the main thread; this one waits


def test_sigterm_sets_the_flag_and_raises_only_in_an_abandoning_block():
    stop = StopSignals(doing="stopping")
    before = signal.getsignal(signal.SIGTERM)
    with stop.installed():
        with stop.abandoning():
            pass
        _signal_self(signal.SIGTERM)  # outside the block: the flag only
        assert stop.requested and stop.reason == "SIGTERM"
        with pytest.raises(StopSignalled), stop.abandoning():  # asked before: raised at once
            pass
    assert signal.getsignal(signal.SIGTERM) is before
    stopped = stop.stopped("where it stands")
    assert str(stopped) == "SIGTERM: where it stands" and stopped.exit_status == 143


def test_ctrl_c_inside_the_block_raises_there_and_a_second_stops_at_once():
    stop = StopSignals(doing="stopping")
    before = signal.getsignal(signal.SIGINT)
    with stop.installed():
        with pytest.raises(StopSignalled), stop.abandoning():
            _signal_self(signal.SIGINT)
        assert stop.requested and stop.reason == "Ctrl-C"
        assert stop.stopped("x").exit_status == 130
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_command_ends_a_stopped_run_with_its_signal_status(capsys):
    stop = StopSignals(doing="stopping")
    stop.requested, stop.reason, stop.signum = True, "Ctrl-C", signal.SIGINT

    def run() -> int:
        raise stop.stopped("3 of 8 rows logged; run the same command again to resume")

    assert report_errors(run, debug=False) == 130
    assert capsys.readouterr().err.splitlines() == [
        "stopped: Ctrl-C: 3 of 8 rows logged; run the same command again to resume"
    ]


def test_a_run_that_handles_sigterm_only_leaves_ctrl_c_to_python():
    stop = StopSignals(doing="stopping", signals=(signal.SIGTERM,))
    with stop.installed():
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == stop.on_signal


def _earlier_sigterm_handler(signum, frame) -> None:
    """A library caller's own SIGTERM handler, there before the run's."""


@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_the_earlier_handlers_are_back_after_the_block_however_it_ends(ending):
    """A run that fails (an error inside the block) gives the caller's handlers back as one that
    ends normally does: a library caller keeps its own."""
    signal.signal(signal.SIGTERM, _earlier_sigterm_handler)
    stop = StopSignals(doing="stopping")
    failing = pytest.raises(RuntimeError) if ending == "raises" else contextlib.nullcontext()
    with failing, stop.installed():
        assert signal.getsignal(signal.SIGTERM) == stop.on_signal
        assert signal.getsignal(signal.SIGINT) == stop.on_signal
        if ending == "raises":
            raise RuntimeError("the run failed")
    assert signal.getsignal(signal.SIGTERM) is _earlier_sigterm_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _sleep_through_a_ctrl_c(started) -> None:
    started.set()
    time.sleep(1.5)  # a KeyboardInterrupt here would end the worker with exit code 1


def test_forked_workers_leave_ctrl_c_to_the_process_that_forked_them():
    """datasets' `map(num_proc=N)` forks its pool inside `ctrl_c_left_to_this_process`: a Ctrl-C
    to the group stops this process (KeyboardInterrupt) and no worker raises its own."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    with ctrl_c_left_to_this_process():
        started = fork.Event()
        worker = fork.Process(target=_sleep_through_a_ctrl_c, args=(started,))
        worker.start()
        assert started.wait(10)
        os.kill(worker.pid, signal.SIGINT)
        worker.join(10)
        assert worker.exitcode == 0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
