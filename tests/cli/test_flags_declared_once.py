"""One declaration per command-line flag (#49 item 2): every flag of `speculators datagen`,
`speculators regenerate`, `speculators gen-and-train` and `speculators demo` (but
--help/--debug/--verbose) is a field of an options dataclass, its help the field's docstring,
made by `cli.field_flags` from the command's `FLAG_SOURCES`; a flag added by hand, or a field
shown twice, fails here."""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import pytest

from speculators_vllm016.cli import datagen, gen_and_train, regenerate
from speculators_vllm016.cli.field_flags import FlagSource, FlagView, source_flags
from speculators_vllm016.data_generation.options import EngineOptions
from speculators_vllm016.demo import cli as demo_cli

# The flags a command declares itself: not settings of the job.
COMMAND_FLAGS = {"-h", "--help", "--debug", "--verbose"}
COMMANDS = {
    "datagen": datagen,
    "regenerate": regenerate,
    "gen-and-train": gen_and_train,
    "demo": demo_cli,
}


def _parser_flags(parser: argparse.ArgumentParser) -> Counter[str]:
    return Counter(flag for action in parser._actions for flag in action.option_strings)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_one_field_of_the_commands_sources(command):
    module = COMMANDS[command]
    declared = Counter(source_flags(module.FLAG_SOURCES))
    twice = sorted(flag for flag, count in declared.items() if count > 1)
    assert not twice, f"{command}: fields shown as one flag twice: {twice}"
    parsed = _parser_flags(module.build_parser())
    by_hand = sorted(set(parsed) - set(declared) - COMMAND_FLAGS)
    assert not by_hand, f"{command}: flags declared by hand, not from a field: {by_hand}"
    assert set(declared) <= set(parsed)
    assert all(count == 1 for count in parsed.values())


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flags_help_is_its_fields_docstring(command):
    parser = COMMANDS[command].build_parser()
    for action in parser._actions:
        if set(action.option_strings) & COMMAND_FLAGS:
            continue
        assert action.help and action.help.strip(), f"{command} {action.option_strings}: no help"


def test_a_hand_added_flag_is_caught(monkeypatch):
    """The check above, on datagen's parser with one flag added by hand beside the fields."""
    real = datagen.build_parser

    def with_extra(prog: str = "speculators datagen") -> argparse.ArgumentParser:
        parser = real(prog)
        parser.add_argument("--max-num-sequences", type=int, help="a second --max-num-seqs")
        return parser

    monkeypatch.setattr(datagen, "build_parser", with_extra)
    with pytest.raises(AssertionError, match="declared by hand"):
        test_every_flag_is_one_field_of_the_commands_sources("datagen")


def test_regenerate_shows_datagens_engine_fields_with_its_own_default():
    """regenerate's engine flags are datagen's fields; --max-num-seqs's default (256: the engine
    only answers turns) is regenerate's override, declared once in its view."""
    args = regenerate.build_parser().parse_args(
        ["--target-model-path", "m", "--train-data-path", "d", "--output-dir", "o"]
    )
    assert args.max_num_seqs == 256
    assert args.gpu_memory_utilization == EngineOptions.gpu_memory_utilization
    assert datagen.build_parser().get_default("max_num_seqs") is None
    assert args.regenerate_seed == 0 and "--seed" in _parser_flags(regenerate.build_parser())
    assert "--regenerate-seed" in _parser_flags(datagen.build_parser())


def test_a_view_naming_no_field_is_refused():
    """A typo in a command's view must not quietly drop a flag."""

    @dataclasses.dataclass
    class Options:
        name: str = ""
        """A name."""

    with pytest.raises(ValueError, match="no fields"):
        source_flags([FlagSource("x", Options, FlagView(names=("nmae",)))])


def test_the_length_flags_help_names_the_defaults_they_are_fitted_from():
    """The docstrings of --max-tokens/--max-prompt-tokens say the defaults in words; they must
    be the ones `fit_lengths_to_model` uses."""
    from speculators_vllm016.cli.regeneration_flags import (
        DEFAULT_MAX_PROMPT_TOKENS,
        DEFAULT_MAX_TOKENS,
    )

    helps = {
        flag: action.help
        for action in regenerate.build_parser()._actions
        for flag in action.option_strings
    }
    assert f"None: {DEFAULT_MAX_TOKENS}," in helps["--max-tokens"]
    assert f"None: {DEFAULT_MAX_PROMPT_TOKENS}," in helps["--max-prompt-tokens"]


def test_the_demos_switches_turn_its_stages_off():
    """demo's on-by-default fields are shown as the `--no-...` switches they always were."""
    args = demo_cli.build_parser().parse_args(["--no-serve", "--no-regenerate", "--no-progress"])
    options = demo_cli.options_from_args(args)
    assert (options.serve, options.regenerate, options.show_progress) == (False, False, False)
    assert demo_cli.options_from_args(demo_cli.build_parser().parse_args([])).serve
