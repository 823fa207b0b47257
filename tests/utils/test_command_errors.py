"""The one error reporter of the commands (datagen, demo, convert, gen-and-train, train): the
package's own errors are one line, any other exception (a bug) keeps its traceback."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError, field_validator
from torch._utils import ExceptionWrapper

from speculators_vllm016.train.data import SampleFileError
from speculators_vllm016.train.trainer import TrainingInterrupted
from speculators_vllm016.utils.command_errors import describe_error, report_errors
from speculators_vllm016.utils.errors import (
    InvalidInputError,
    RunFailedError,
    library_refusals_as_ours,
)


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
    assert report_errors(fail(InvalidInputError("bad flag\nmore")), debug=False) == 2
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
    with pytest.raises(InvalidInputError):
        report_errors(fail(InvalidInputError("x")), debug=True)
    with pytest.raises(RuntimeError):  # not expected by this command: the traceback shows
        report_errors(fail(RuntimeError("bug")), debug=False, expected=(SampleFileError,))


@pytest.mark.parametrize("bug", [ValueError("invalid literal for int()"), RuntimeError("boom")])
def test_a_builtin_error_of_no_package_code_keeps_its_traceback(bug):
    """A bare ValueError/RuntimeError comes from a bug, not from a check of the package: the
    commands used to print its one line and hide where it came from."""

    def run():
        raise bug

    with pytest.raises(type(bug)):
        report_errors(run, debug=False)


def _validation_error() -> ValidationError:
    """What 0.3.0's pydantic configs raise for a value that does not validate."""
    try:
        TypeAdapter(bool).validate_python("maybe")
    except ValidationError as error:
        return error
    raise AssertionError("validated")


@pytest.mark.parametrize(
    "error",
    [
        InvalidInputError("--seq-length must be at least 1"),
        RunFailedError("the engine stopped"),
        SampleFileError("data_3.pt is truncated"),
        FileNotFoundError(2, "No such file or directory", "chats.jsonl"),
        _validation_error(),
    ],
)
def test_the_package_s_errors_and_missing_files_are_one_line(error, capsys):
    def run():
        raise error

    assert report_errors(run, debug=False) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


class _Context(BaseModel):
    length: int

    @field_validator("length")
    @classmethod
    def _within_the_model(cls, value: int) -> int:
        if value > 2048:
            raise ValueError(f"length ({value}) is greater than the model's 2048")
        return value


def test_a_validation_errors_line_carries_pydantics_message():
    """Its first line ("1 validation error for _Context") names no problem; the line says
    which field and what pydantic found, bare or wrapped as `library_refusals_as_ours` wraps it."""
    try:
        _Context(length=2049)
    except ValidationError as error:
        bare = error
    line = describe_error(bare)
    assert (
        line.startswith("_Context: length: ") and "(2049) is greater than the model's 2048" in line
    )
    with pytest.raises(InvalidInputError) as wrapped, library_refusals_as_ours():
        raise bare
    assert describe_error(wrapped.value) == line


def test_vllms_refusal_of_an_engine_setting_is_one_line_with_its_reason(tiny_llama, capsys):
    """vLLM's own config check (a pydantic validator) through the path an engine start takes."""
    from vllm.engine.arg_utils import EngineArgs

    def run() -> int:
        with library_refusals_as_ours():
            EngineArgs(model=str(tiny_llama), max_model_len=4096).create_engine_config()
        return 0

    assert report_errors(run, debug=False) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "User-specified max_model_len (4096) is greater than the derived" in lines[0], lines
