"""`speculators datagen`: the flags of 0.3.0's scripts/data_generation_offline.py, and more.

Parsed with argparse so that 0.3.0 invocations (`--layer-ids 2 16 29 31`) keep working.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from speculators_vllm016.cli.regeneration_flags import (
    add_regeneration_arguments,
    fit_lengths_to_model,
    refuse_misplaced_regeneration_flags,
    sampling_from_args,
)
from speculators_vllm016.data_generation.options import DTYPES, DatagenOptions
from speculators_vllm016.data_generation.vllm_logging import keep_vllm_quiet
from speculators_vllm016.utils.command_errors import EXIT_STOPPED, report_errors

__all__ = [
    "add_preprocessing_arguments",
    "add_sample_file_arguments",
    "add_target_model_arguments",
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


def add_target_model_arguments(group, required: bool = True) -> None:
    """The target model and engine flags (shared with `speculators train --online`)."""
    group.add_argument(
        "--target-model-path", required=required, default=None, help="HF model id or local folder"
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs (or CPU workers) per model copy; 0.3.0 used every visible GPU, now 1",
    )
    group.add_argument(
        "--pipeline-parallel-size", type=int, default=1, help="pipeline stages per model copy"
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine context length; None: --seq-length + 1",
    )
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=0.8, help="share of GPU memory vLLM may use"
    )
    group.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype")
    group.add_argument(
        "--max-num-seqs", type=int, default=None, help="engine batch; None: max(32, --batch-size)"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step; None: max(8192, max model len)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run Python code shipped in the model folder (some models need it, e.g. Kimi-K2.5); "
        "off by default (0.3.0 always ran it)",
    )
    group.add_argument(
        "--transfer-root",
        default=None,
        help="folder for the shared-memory files that carry hidden states from the engine; "
        "None: $SPECULATORS_TRANSFER_ROOT, else /dev/shm, else the temp dir",
    )


def add_preprocessing_arguments(
    group, required: bool = True, seed_flag: str = "--seed", token_freq: bool = True
) -> None:
    """The chat-data flags: which rows, how they are tokenized and masked (shared with train)."""
    group.add_argument(
        "--train-data-path",
        required=required,
        default=None,
        help="local .json/.jsonl (ShareGPT or messages shape), or 'sharegpt' / 'ultrachat'",
    )
    group.add_argument("--seq-length", type=int, default=2048, help="truncate samples to this")
    group.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="use at most this many conversations; None: all",
    )
    if token_freq:
        group.add_argument(
            "--token-freq-path",
            default=None,
            help="also write the token counts here (0.3.0's file; '.shard-I-of-N' is added when "
            "sharded); they always go to <output-dir>/token_freq/",
        )
    group.add_argument("--hf-cache-dir", default=None, help="datasets cache directory")
    group.add_argument(
        "--assistant-pattern",
        default=None,
        help="regex whose first group is assistant text; None: found from the chat template",
    )
    group.add_argument(
        "--turn-dropout", action="store_true", help="keep a random prefix of each conversation"
    )
    group.add_argument(
        seed_flag,
        type=int,
        default=0,
        dest="seed" if seed_flag == "--seed" else None,
        help="shuffle seed of the chat data (datagen's --seed)",
    )
    group.add_argument(
        "--num-preprocessing-workers", type=int, default=8, help="processes for tokenizing"
    )
    group.add_argument(
        "--chat-template-kwargs",
        default=None,
        help="JSON object of arguments for the chat template, e.g. '{\"thinking\": false}' "
        "(Kimi-K2.5); with --regenerate the target answers with them too. None: the "
        "template's defaults (0.3.0's rendering)",
    )

    group.add_argument(
        "--session-tokens",
        type=int,
        default=0,
        help="also write long samples: the user/assistant pairs of the conversations, in their "
        "(seeded) order, chained into sessions of about N tokens (whole pairs; at most "
        "--seq-length); 0: none",
    )
    group.add_argument(
        "--sessions-only",
        action="store_true",
        help="with --session-tokens: write the sessions only, not the conversations themselves",
    )


def add_sample_file_arguments(group) -> None:
    """Which layers are captured and how sample files are written (shared with train)."""
    group.add_argument(
        "--output-format", choices=["pt", "safetensors"], default="pt", help="sample file format"
    )
    group.add_argument(
        "--storage-dtype",
        choices=["bf16", "fp8"],
        default="bf16",
        help=(
            "how hidden states are stored: bf16 as the engine makes them; fp8 (e4m3, one scale "
            "per token and layer) takes half the bytes, read back by `speculators train` only "
            "(docs/storage-dtype.md measures what it costs)"
        ),
    )
    group.add_argument("--start-idx", type=int, default=0, help="index of the first file")
    group.add_argument(
        "--layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="decoder layers to capture; None: [2, N/2, N-3, N-1] of N layers",
    )
    group.add_argument(
        "--num-writer-threads", type=int, default=4, help="threads writing sample files"
    )
    group.add_argument(
        "--fsync",
        action="store_true",
        help="fsync every sample file (survives power loss; files are always whole after a crash)",
    )


def add_ray_arguments(group) -> None:
    """The flags that run every shard as a Ray task (`data_generation.ray_shards`)."""
    group.add_argument(
        "--ray-address",
        default=None,
        help="run the --num-shards shards as tasks on this Ray cluster ('ray start' address, "
        "or 'auto'), or 'local' to start Ray on this machine; needs "
        "pip install 'speculators-vllm016[ray]'",
    )
    group.add_argument(
        "--ray-max-retries",
        type=int,
        default=2,
        help="times a failed or killed shard is started again (it resumes) before the run fails",
    )


def build_parser(prog: str = "speculators datagen") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Generate EAGLE-3 training data: target-model hidden states for chat data.",
        epilog=EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_target_model_arguments(parser.add_argument_group("target model"))
    add_preprocessing_arguments(parser.add_argument_group("data"))

    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", required=True, help="folder for the sample files")
    add_sample_file_arguments(output)
    output.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help=(
            "sequences per extraction call (0.3.0 used 8). The engine runs a call's sequences "
            "continuously and samples are written as they finish, but each call ends with a "
            "partly filled step, so larger is faster; a resumed run computes only the missing samples"
        ),
    )
    output.add_argument("--num-shards", type=int, default=1, help="shards of the whole job")
    output.add_argument("--shard-index", type=int, default=0, help="this process's shard")
    output.add_argument(
        "--adopt-existing",
        action="store_true",
        help="accept a folder that holds sample files of an unrecorded run (e.g. 0.3.0's): "
        "each is checked against this run's samples and recomputed if it differs",
    )
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_ray_arguments(parser.add_argument_group("Ray (all shards from one command)"))
    regeneration = parser.add_argument_group(
        "regeneration (one engine load: answer the turns with the target, then extract)"
    )
    regeneration.add_argument(
        "--regenerate",
        action="store_true",
        help="first replace every assistant turn by the target's own response (as `speculators "
        "regenerate` does), then extract the regenerated conversations",
    )
    regeneration.add_argument(
        "--regenerate-dir",
        default=None,
        help="folder of the regenerated conversations; None: <output-dir>/regenerated",
    )
    # --chat-template-kwargs is the data group's: one flag for both halves of a --regenerate run.
    add_regeneration_arguments(regeneration, seed_flag="--regenerate-seed", template_kwargs=False)
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

    fit_lengths_to_model(args)
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
