"""`cli.field_flags` on small options dataclasses: what a `FlagView` changes (and that a typo in
any of its parts is refused), which fields are required, and that sources of one title share one
argument group. The commands' own parsers are held by tests/cli/test_flags_declared_once.py."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from speculators_vllm016.cli.field_flags import FlagSource, FlagView, add_flag_sources


@dataclasses.dataclass
class Engine:
    model: str
    """Where the model is."""
    seqs: int = 8
    """Sequences at once."""
    layers: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    """Layers to read."""


@dataclasses.dataclass
class Data:
    data_path: str = "d.jsonl"
    """The chats."""


def _parser(sources: list[FlagSource]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="x", exit_on_error=False)
    add_flag_sources(parser, sources)
    return parser


def _help(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {flag: action.help for action in parser._actions for flag in action.option_strings}


def test_a_field_without_a_default_is_required_and_one_with_a_factory_is_not():
    parser = _parser([FlagSource("engine", Engine)])
    args = parser.parse_args(["--model", "m"])
    assert (args.model, args.seqs, args.layers) == ("m", 8, [1, 2])
    with pytest.raises(SystemExit):
        parser.parse_args([])


def test_a_view_gives_its_own_default_flag_and_note_and_a_default_makes_a_field_optional():
    view = FlagView(
        defaults={"model": "", "seqs": 256},  # even a default that is empty
        flags={"seqs": "--max-seqs"},
        notes={"seqs": "Here 256."},
    )
    parser = _parser([FlagSource("engine", Engine, view)])
    args = parser.parse_args([])
    assert (args.model, args.seqs) == ("", 256)
    assert parser.parse_args(["--max-seqs", "3"]).seqs == 3  # parsed under the field's name
    assert _help(parser)["--max-seqs"] == "Sequences at once. Here 256."


@pytest.mark.parametrize("part", ["names", "flags", "defaults", "notes"])
def test_a_typo_in_any_part_of_a_view_is_refused(part):
    """A misspelt field must not quietly leave a flag as it was."""
    value = ("modle",) if part == "names" else {"modle": "--x" if part == "flags" else "y"}
    with pytest.raises(ValueError, match=r"no fields \['modle'\]"):
        _parser([FlagSource("engine", Engine, FlagView(**{part: value}))])


def test_sources_of_one_title_share_one_group():
    parser = _parser(
        [
            FlagSource("inputs", Engine, FlagView(defaults={"model": "m"})),
            FlagSource("inputs", Data),
        ]
    )
    titles = [group.title for group in parser._action_groups]
    assert titles.count("inputs") == 1
    (inputs,) = [group for group in parser._action_groups if group.title == "inputs"]
    assert {a.dest for a in inputs._group_actions} == {"model", "seqs", "layers", "data_path"}
