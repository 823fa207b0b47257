"""`speculators datagen`: the flags of 0.3.0's scripts/data_generation_offline.py, and more.

Parsed with argparse so that 0.3.0 invocations (`--layer-ids 2 16 29 31`) keep working.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from speculators_vllm016.cli.field_flags import FlagSource, add_flag_sources
from speculators_vllm016.cli.regeneration_flags import (
    OnePassFlags,
    RegenerationFlags,
    fit_lengths_to_model,
    refuse_misplaced_regeneration_flags,
    regeneration_view,
    sampling_from_args,
)
from speculators_vllm016.data_generation.options import (
    DatagenOptions,
    EngineOptions,
    OutputOptions,
    PreprocessingOptions,
    RayOptions,
)
from speculators_vllm016.data_generation.vllm_logging import keep_vllm_quiet
from speculators_vllm016.utils.command_errors import EXIT_STOPPED, report_errors

__all__ = [
    "FLAG_SOURCES",
    "build_parser",
    "main",
    "options_from_args",
    "refuse_misplaced_flags",
    "regeneration_options",
]

EPILOG = """\
Sharding: run one process per machine with the same flags and --num-shards N --shard-index I,
all into one --output-dir; shard I extracts rows I, I+N, I+2N, ... and names files by their
global index, so the shards' files together are exactly the unsharded run's. With --regenerate,
shard I regenerates rows I, I+N, ... of the data, then waits for the other shards' regenerated
rows (samples are numbered over all of them): start every shard at once. A killed run resumes
where it stopped when started again with the same command. Token counts go to
<output-dir>/token_freq/shard-I-of-N.pth, the lengths index to <output-dir>/manifest/.
With --ray-address (a cluster's address, or 'local') one command runs all N shards as Ray tasks,
each with tensor x pipeline parallel size GPUs, restarts a failed shard up to --ray-max-retries
times and writes each shard's output to <output-dir>/logs/shard-I-of-N.log.
"""


_REGENERATION = "regeneration (one engine load: answer the turns with the target, then extract)"
# Every flag but --help/--debug/--verbose, each a field of one of these (`cli.field_flags`): the
# target-model, data and output flags are shared with `speculators train --online` and (some)
# with `speculators regenerate`, the regeneration flags with both. --chat-template-kwargs is the
# data group's: one flag for both halves of a --regenerate run; the sampling seed is
# --regenerate-seed (--seed shuffles the data).
FLAG_SOURCES = [
    FlagSource("target model", EngineOptions),
    FlagSource("data", PreprocessingOptions),
    FlagSource("output", OutputOptions),
    FlagSource("Ray (all shards from one command)", RayOptions),
    FlagSource(_REGENERATION, OnePassFlags),
    FlagSource(_REGENERATION, RegenerationFlags, regeneration_view("--regenerate-seed", False)),
]


def build_parser(prog: str = "speculators datagen") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Generate EAGLE-3 training data: target-model hidden states for chat data.",
        epilog=EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flag_sources(parser, FLAG_SOURCES)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's own start-up lines (by default only its warnings and errors show)",
    )
    return parser


def options_from_args(args: argparse.Namespace) -> DatagenOptions:
    """Datagen's parsed flags as options (`DatagenOptions.from_args`, which train's --online uses too)."""
    return DatagenOptions.from_args(args)


def refuse_misplaced_flags(args: argparse.Namespace, allow_shards: bool = True) -> None:
    """Regeneration flags without --regenerate, or --regenerate on Ray (or with shards, unless
    `allow_shards`): one-line errors."""
    refuse_misplaced_regeneration_flags(
        args,
        seed_flag="--regenerate-seed",
        extra={"regenerate_dir": "--regenerate-dir"},
        allow_shards=allow_shards,
    )


def regeneration_options(args: argparse.Namespace):
    """The `--regenerate` half of a datagen command, as `speculators regenerate` options."""
    from speculators_vllm016.data_generation.options import parse_template_kwargs
    from speculators_vllm016.data_generation.regeneration.one_pass import default_regenerate_dir
    from speculators_vllm016.data_generation.regeneration.options import RegenerateOptions

    target_config = fit_lengths_to_model(args)  # None where it read no config
    return RegenerateOptions(
        target_model_path=args.target_model_path,
        train_data_path=args.train_data_path,
        output_dir=args.regenerate_dir or default_regenerate_dir(args.output_dir),
        sampling=sampling_from_args(args),
        chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs),
        reasoning=args.reasoning,
        tool_rows=args.tool_rows,
        max_prompt_tokens=args.max_prompt_tokens,
        max_samples=args.max_samples,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        batch_size=args.batch_size,
        trust_remote_code=args.trust_remote_code,
        hf_cache_dir=args.hf_cache_dir,
        num_preprocessing_workers=args.num_preprocessing_workers,
        fsync=args.fsync,
        show_progress=not args.no_progress,
        target_config=target_config,
    )


def main(argv: Sequence[str] | None = None, prog: str = "speculators datagen") -> int:
    args = build_parser(prog).parse_args(argv)  # before the engine's imports: `--help` is quick
    if not args.verbose:
        keep_vllm_quiet()
    from speculators_vllm016.data_generation.offline import run_datagen, summary_json

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def run() -> int:
        refuse_misplaced_flags(args)
        if args.ray_address is not None:
            return run_on_ray(args)
        if args.regenerate:
            from speculators_vllm016.data_generation.regeneration.one_pass import (
                run_datagen_regenerating,
            )

            regenerated, summary = run_datagen_regenerating(
                options_from_args(args), regeneration_options(args)
            )
            print(f"Regenerated: {regenerated.describe()}")
        else:
            summary = run_datagen(options_from_args(args))
        print(f"Done: {summary.describe()}")
        print(f"SUMMARY {summary_json(summary)}")
        return 0

    return report_errors(run, args.debug)


def run_on_ray(args: argparse.Namespace) -> int:
    """Every shard of the job as a Ray task (`--ray-address`); one SUMMARY line for them all."""
    import json
    from dataclasses import asdict

    from speculators_vllm016.data_generation.ray_shards import StopRequested, run_shards_on_ray

    try:
        summary = run_shards_on_ray(
            options_from_args(args), args.ray_address, args.ray_max_retries, verbose=args.verbose
        )
    except StopRequested as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        return EXIT_STOPPED
    print(f"Done: {summary.describe()}")
    print(f"SUMMARY {json.dumps(asdict(summary))}")
    return 0
