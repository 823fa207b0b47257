"""The package's error base, and one-line summaries of errors (pure logic)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import speculators_vllm016
from speculators_vllm016.utils.errors import (
    InvalidInputError,
    RunFailedError,
    first_line,
    library_refusals_as_ours,
    type_and_first_line,
)


@pytest.mark.parametrize(
    ("error", "line", "typed"),
    [
        (ValueError("bad value\nmore detail"), "bad value", "ValueError: bad value"),
        (
            RuntimeError("\n\n  Error(s) in loading:\n\tsize mismatch"),
            "Error(s) in loading:",
            "RuntimeError: Error(s) in loading:",
        ),
        (EOFError(), "EOFError", "EOFError"),
        (OSError("   \n  "), "OSError", "OSError"),
    ],
)
def test_one_line_of_any_message(error: BaseException, line: str, typed: str) -> None:
    assert first_line(error) == line
    assert type_and_first_line(error) == typed


def _package_classes() -> dict[str, list[str]]:
    """Every class the package defines, by name, with its bases' last name parts (read with
    `ast`: importing every module would start vLLM)."""
    classes: dict[str, list[str]] = {}
    for path in sorted(Path(speculators_vllm016.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).split(".")[-1] for base in node.bases]
                classes[f"{path.stem}.{node.name}"] = bases
    return classes


def _is_exception(base: str) -> bool:
    return (
        isinstance(getattr(builtins, base, None), type)
        and issubclass(getattr(builtins, base), BaseException)
        or base in ("UnpicklingError", "PickleError")
    )


def test_every_error_class_of_the_package_derives_from_speculators_error():
    """The commands print a `SpeculatorsError` as one line: an error class outside that tree
    would show a traceback for a user's mistake (or, caught by a built-in base, hide a bug)."""
    classes = _package_classes()
    by_name = {key.split(".")[-1]: bases for key, bases in classes.items()}

    def ancestors(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        found = {name}
        for base in by_name.get(name, []):
            if base not in seen:
                found |= ancestors(base, seen | {name})
        return found

    errors = [key for key in classes if any(map(_is_exception, ancestors(key.split(".")[-1])))]
    # Control flow, like KeyboardInterrupt: raised and caught inside the package (a stop signal
    # becomes `RunStopped`), never shown; each such class is named here deliberately.
    control_flow = [key for key in errors if classes[key] == ["BaseException"]]
    assert control_flow == ["stop_signals.StopSignalled"]
    outside = [
        key
        for key in errors
        if key not in control_flow and "SpeculatorsError" not in ancestors(key.split(".")[-1])
    ]
    assert len(errors) > 20  # the walk finds them (17 classes in 10 modules, and the base's own)
    assert not outside, outside


@pytest.mark.parametrize(
    ("raised", "becomes"),
    [
        (ValueError("max_model_len 4096 exceeds the KV cache"), InvalidInputError),
        (RuntimeError("Engine core initialization failed"), RunFailedError),
    ],
)
def test_a_library_refusal_becomes_ours_with_its_message(raised, becomes):
    with pytest.raises(becomes) as caught, library_refusals_as_ours():
        raise raised
    assert str(caught.value) == str(raised) and caught.value.__cause__ is raised
    assert isinstance(caught.value, type(raised))  # an `except ValueError` still catches it


@pytest.mark.parametrize(
    "raised", [InvalidInputError("ours already"), KeyError("a bug"), OSError(28, "disk full")]
)
def test_other_errors_pass_library_refusals_unchanged(raised):
    with pytest.raises(type(raised)) as caught, library_refusals_as_ours():
        raise raised
    assert caught.value is raised
