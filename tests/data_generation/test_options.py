"""Datagen's options: three typed parts, one builder from parsed flags, the flat names kept."""

from __future__ import annotations

from dataclasses import fields

import pytest

from speculators_vllm016.cli.datagen import build_parser
from speculators_vllm016.data_generation.options import (
    DatagenOptions,
    EngineOptions,
    OutputOptions,
    PreprocessingOptions,
)
from speculators_vllm016.utils.errors import InvalidInputError

REQUIRED = ["--target-model-path", "m", "--train-data-path", "d", "--output-dir", "o"]


def test_every_datagen_flag_lands_in_exactly_one_part():
    args = build_parser().parse_args(
        [
            *REQUIRED,
            "--seq-length",
            "300",
            "--dtype",
            "float32",
            "--batch-size",
            "4",
            "--no-progress",
            "--layer-ids",
            "1",
            "2",
        ]
    )
    options = DatagenOptions.from_args(args)
    assert options.engine.dtype == "float32" and options.engine.target_model_path == "m"
    assert options.preprocessing.seq_length == 300
    assert options.output.batch_size == 4 and options.output.layer_ids == [1, 2]
    assert options.output.show_progress is False
    names = [
        item.name
        for part in (EngineOptions, PreprocessingOptions, OutputOptions)
        for item in fields(part)
    ]
    assert len(names) == len(set(names))
    flags = set(vars(args)) - {"debug", "no_progress", "verbose"}  # console-only flags
    flags -= {"ray_address", "ray_max_retries"}  # how the shards are started, not what they make
    flags -= regeneration_flags()  # `--regenerate`'s own options (`RegenerateOptions`)
    assert flags == set(names) - {"show_progress"}


def regeneration_flags() -> set[str]:
    """The destinations of datagen's `--regenerate` flags, which make `RegenerateOptions`."""
    import argparse

    from speculators_vllm016.cli.regeneration_flags import add_regeneration_arguments

    parser = argparse.ArgumentParser()
    add_regeneration_arguments(parser, seed_flag="--regenerate-seed", template_kwargs=False)
    return set(vars(parser.parse_args([]))) | {"regenerate", "regenerate_dir"}


def test_overrides_win_and_unknown_names_are_refused():
    args = build_parser().parse_args(REQUIRED)
    options = DatagenOptions.from_args(args, seed=7, output_dir="")
    assert options.preprocessing.seed == 7 and options.output.output_dir == ""
    with pytest.raises(TypeError, match="not datagen options: lr"):
        DatagenOptions.from_args(args, lr=1.0)
    with pytest.raises(TypeError, match="unknown flag 'lr'"):
        DatagenOptions(target_model_path="m", train_data_path="d", output_dir="o", lr=1.0)


def test_flat_names_read_and_write_the_parts():
    options = DatagenOptions(
        target_model_path="m", train_data_path="d", output_dir="o", seq_length=9
    )
    assert options.seq_length == 9 and options.resolved_max_model_len == 10
    options.transfer_root = "/x"
    assert options.engine.transfer_root == "/x"
    parts = DatagenOptions(
        engine=EngineOptions("m"),
        preprocessing=PreprocessingOptions("d", seq_length=9),
        output=OutputOptions("o"),
    )
    parts.transfer_root = "/x"
    assert parts == options


def test_chat_template_kwargs_are_a_data_flag_checked_before_any_work():
    """One `--chat-template-kwargs` for datagen (plain, and both halves of --regenerate); it is
    unset by default, so the template renders as in 0.3.0."""
    from speculators_vllm016.cli.datagen import regeneration_options

    plain = DatagenOptions.from_args(build_parser().parse_args(REQUIRED))
    assert plain.preprocessing.template_kwargs() == {}
    argv = [*REQUIRED, "--regenerate", "--chat-template-kwargs", '{"thinking": false}']
    args = build_parser().parse_args(argv)
    options = DatagenOptions.from_args(args)
    assert options.preprocessing.template_kwargs() == {"thinking": False}
    assert regeneration_options(args).chat_template_kwargs == {"thinking": False}
    for bad, problem in (("{thinking}", "is not JSON"), ("[1]", "must be a JSON object")):
        options.preprocessing.chat_template_kwargs = bad
        with pytest.raises(InvalidInputError, match=problem):
            options.validate()
