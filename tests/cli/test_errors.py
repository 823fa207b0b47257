"""The one error reporter of the commands (datagen, demo, convert, gen-and-train, train)."""

from __future__ import annotations

import pytest
from torch._utils import ExceptionWrapper

from speculators_vllm016.cli.errors import describe_error, report_errors
from speculators_vllm016.train.data import SampleFileError
from speculators_vllm016.train.trainer import TrainingInterrupted


def worker_error() -> SampleFileError:
    """The error as a DataLoader worker hands it to the main process (torch's own wrapper)."""
    try:
        raise SampleFileError("data_3.pt is truncated; run datagen again")
    except SampleFileError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapper.reraise()
    except SampleFileError as error:
        return error
    raise AssertionError("reraise returned")


def test_a_wrapped_worker_error_is_its_original_message():
    assert describe_error(worker_error()).endswith("data_3.pt is truncated; run datagen again")


def test_other_errors_give_their_first_line():
    assert describe_error(ValueError("--seq-length must be positive\ndetails")) == (
        "--seq-length must be positive"
    )


def test_exit_statuses_and_one_line(capsys):
    def fail(error):
        def run():
            raise error

        return run

    assert report_errors(lambda: 0, debug=False) == 0
    assert report_errors(fail(ValueError("bad flag\nmore")), debug=False) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: bad flag (--debug shows the traceback)"
    ]
    stopped = report_errors(
        fail(TrainingInterrupted("SIGTERM; checkpoint saved")),
        False,
        stopped=(TrainingInterrupted,),
    )
    assert (
        stopped == 143 and capsys.readouterr().err.strip() == "stopped: SIGTERM; checkpoint saved"
    )
    assert report_errors(fail(KeyboardInterrupt()), debug=False) == 130
    with pytest.raises(ValueError):
        report_errors(fail(ValueError("x")), debug=True)
    with pytest.raises(RuntimeError):  # not expected by this command: the traceback shows
        report_errors(fail(RuntimeError("bug")), debug=False, expected=(SampleFileError,))
