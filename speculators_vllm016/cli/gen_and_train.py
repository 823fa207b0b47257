"""`speculators gen-and-train`: datagen, vocabulary maps and draft training in one resumable command.

The successor of 0.3.0's `scripts/gen_and_train.py`. Its own flags name the job and its folder;
every other flag belongs to `speculators datagen` or `speculators train` and is handed to that
stage unchanged. Layout under --output-dir: `data/` (datagen), `vocab/{d2t,t2d}.npy`,
`checkpoints/` (training). Run the same command again after a crash: datagen computes only missing
samples, the maps are kept while their sizes match the flags, and training resumes from its newest
checkpoint, ending bit-identical to an uninterrupted run. With `--regenerate` (and datagen's
regeneration flags) the target first answers the chat turns itself, in the same engine load as
datagen (`data/regenerated/`). This module only parses the command line into a `PipelinePlan`;
the stages are `pipeline.gen_and_train`'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculators_vllm016.cli.field_flags import FlagSource, add_flag_sources
from speculators_vllm016.pipeline.gen_and_train import PipelinePlan
from speculators_vllm016.train.jobs.job_config import JobConfigError
from speculators_vllm016.train.jobs.vocab_size_rule import draft_vocab_too_large
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.regeneration.options import RegenerateOptions

__all__ = ["FLAG_SOURCES", "GenAndTrainFlags", "build_parser", "main", "plan_from_argv"]


@dataclass
class GenAndTrainFlags:
    """gen-and-train's own flags (every other flag is datagen's or train's, passed on)."""

    target_model_path: str | None = None
    """The target (verifier) model: hub id or local folder."""
    train_data_path: str | None = None
    """Chat data, as for datagen."""
    output_dir: str | None = None
    """Folder for data/, vocab/ and checkpoints/."""
    draft_vocab_size: int = 32000
    """Tokens the draft predicts."""
    target_vocab_size: int | None = None
    """Target vocabulary size; None: from the target's config."""
    seed: int = 0
    """Seed of datagen's shuffle and of training."""
    no_progress: bool = False
    """Hide the progress bars."""


# Every flag but --help/--debug (`cli.field_flags`); the three paths are checked by
# `plan_from_argv` (a missing one is named with the others).
FLAG_SOURCES = [FlagSource("", GenAndTrainFlags)]


def build_parser(prog: str = "speculators gen-and-train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Generate hidden states, build the draft vocabulary maps and train an EAGLE-3 draft, "
            "each stage resumable. Any other flag of `speculators datagen --help` or "
            "`speculators train --help` is passed to that stage; with datagen's --regenerate "
            "(and its regeneration flags) the target first answers the chat turns itself, in "
            "the same engine load as datagen."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
        allow_abbrev=False,
    )
    parser.add_argument(
        "-h", "--help", action="store_true", help="show this help and the stages' flags"
    )
    add_flag_sources(parser, FLAG_SOURCES)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.allow_abbrev = False  # a train flag must never be read as a prefix of a datagen flag
    return parser


def plan_from_argv(argv: Sequence[str]) -> PipelinePlan:
    """Split the command line among the stages; an unknown flag is an error naming it."""
    from speculators_vllm016.cli import datagen as datagen_cli
    from speculators_vllm016.cli import train as train_cli

    own, rest = build_parser().parse_known_args(list(argv))
    missing = [
        f for f in ("target_model_path", "train_data_path", "output_dir") if not getattr(own, f)
    ]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise SystemExit(f"error: gen-and-train needs {flags} (see --help)")
    if own.draft_vocab_size < 1:
        raise SystemExit(
            f"error: --draft-vocab-size must be at least 1, got {own.draft_vocab_size}"
        )
    if own.target_vocab_size is not None and own.target_vocab_size < own.draft_vocab_size:
        raise SystemExit(
            f"error: {draft_vocab_too_large(own.draft_vocab_size, own.target_vocab_size)}"
        )
    root = Path(own.output_dir)
    shared = ["--seed", str(own.seed)] + (["--no-progress"] if own.no_progress else [])
    shared += ["--debug"] if own.debug else []
    for flag in (
        "--output-dir",
        "--data-path",
        "--verifier-name-or-path",
        "--d2t-path",
        "--t2d-path",
        "--regenerate-dir",
    ):
        if flag in rest:
            raise SystemExit(
                f"error: {flag} is set by gen-and-train from --output-dir/--target-model-path"
            )
    datagen_argv = [
        "--target-model-path",
        own.target_model_path,
        "--train-data-path",
        own.train_data_path,
        "--output-dir",
        str(root / "data"),
        *shared,
    ]
    datagen_parser = _strict(datagen_cli.build_parser())
    datagen_args, rest = datagen_parser.parse_known_args(datagen_argv + rest)
    regenerate = _regeneration_of(datagen_args)
    train_argv = [
        "--verifier-name-or-path",
        own.target_model_path,
        "--data-path",
        str(root / "data"),
        "--d2t-path",
        str(root / "vocab" / "d2t.npy"),
        "--t2d-path",
        str(root / "vocab" / "t2d.npy"),
        "--save-path",
        str(root / "checkpoints"),
        *shared,
    ]
    # --save-path may be given to put checkpoints elsewhere; a later value wins in argparse.
    try:
        train_config, unknown = train_cli.config_from_argv(train_argv + rest, allow_unknown=True)
    except JobConfigError as error:
        raise SystemExit(f"error: {error}") from None
    if unknown:
        raise SystemExit(
            f"error: unknown flag(s) {' '.join(unknown)}: not a flag of gen-and-train, "
            "datagen or train (see --help)"
        )
    return PipelinePlan(
        root=root,
        datagen=datagen_args,
        datagen_argv=sorted(datagen_argv + list(rest)),
        train=train_config,
        draft_vocab_size=own.draft_vocab_size,
        target_vocab_size=own.target_vocab_size,
        debug=own.debug,
        regenerate=regenerate,
        datagen_defaults={name: datagen_parser.get_default(name) for name in vars(datagen_args)},
    )


def _regeneration_of(datagen_args: argparse.Namespace) -> RegenerateOptions | None:
    """The regeneration job of `--regenerate` (into `data/regenerated/`), its flags checked;
    None without it (then no regeneration flag may be given)."""
    from speculators_vllm016.cli import datagen as datagen_cli

    try:
        datagen_cli.refuse_misplaced_flags(datagen_args, allow_shards=False)
        if not datagen_args.regenerate:
            return None
        regenerate = datagen_cli.regeneration_options(datagen_args)
        regenerate.validate()
    except InvalidInputError as error:
        raise SystemExit(f"error: {error}") from None
    return regenerate


def main(argv: Sequence[str] | None = None, prog: str = "speculators gen-and-train") -> int:
    from speculators_vllm016.cli import datagen as datagen_cli
    from speculators_vllm016.cli import train as train_cli
    from speculators_vllm016.pipeline.gen_and_train import run_gen_and_train
    from speculators_vllm016.utils.command_errors import error_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser(prog).print_help()
        print(
            "\n--- datagen stage (flags other than --target-model-path/--train-data-path/--output-dir"
            "/--regenerate-dir) ---"
        )
        datagen_cli.build_parser().print_help()
        print("\n--- training stage (data, maps and --save-path are set from --output-dir) ---")
        train_cli.build_parser().print_help()
        return 0
    try:
        plan = plan_from_argv(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(error_line(stop.code.removeprefix("error: ")), file=sys.stderr)
            return 2
        return int(stop.code or 0)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    return run_gen_and_train(plan, train_cli.run_config)
