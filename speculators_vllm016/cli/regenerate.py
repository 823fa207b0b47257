"""`speculators regenerate`: chat data with every assistant turn answered by the target itself.

The output is a JSONL of `messages` rows that `speculators datagen --train-data-path` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

from speculators_vllm016.cli.datagen import keep_vllm_quiet
from speculators_vllm016.cli.field_flags import FlagSource, FlagView, add_flag_sources
from speculators_vllm016.cli.regeneration_flags import (
    RegenerationFlags,
    fit_lengths_to_model,
    regeneration_view,
    sampling_from_args,
)
from speculators_vllm016.data_generation.options import (
    EngineOptions,
    PreprocessingOptions,
    parse_template_kwargs,
)
from speculators_vllm016.data_generation.regeneration.options import RegenerateOptions
from speculators_vllm016.utils.command_errors import report_errors

__all__ = ["FLAG_SOURCES", "build_parser", "main", "regenerate_options_from_args"]

# Every flag but --help/--debug/--verbose, each a field of one of these (`cli.field_flags`): the
# target-model and data flags are datagen's own fields, shown with regenerate's defaults where
# they differ (--max-num-seqs 256: the engine only answers turns); the regeneration flags are
# datagen --regenerate's, with the sampling seed as --seed.
FLAG_SOURCES = [
    FlagSource(
        "target model",
        EngineOptions,
        FlagView(
            names=(
                "target_model_path",
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "max_model_len",
                "gpu_memory_utilization",
                "dtype",
                "max_num_seqs",
                "trust_remote_code",
            ),
            defaults={"max_num_seqs": 256},
            notes={
                "max_model_len": "Here None: --max-prompt-tokens + --max-tokens (their defaults "
                "are lowered to fit the model's context).",
                "max_num_seqs": "Here 256 unless given.",
            },
        ),
    ),
    FlagSource(
        "server (instead of the in-process engine)",
        RegenerateOptions,
        FlagView(names=("endpoint", "endpoint_model", "concurrency", "request_timeout", "retries")),
    ),
    FlagSource(
        "data",
        PreprocessingOptions,
        FlagView(
            names=("train_data_path", "max_samples", "hf_cache_dir", "num_preprocessing_workers")
        ),
    ),
    FlagSource("regeneration", RegenerationFlags, regeneration_view("--seed")),
    FlagSource(
        "output",
        RegenerateOptions,
        FlagView(
            names=(
                "output_dir",
                "num_shards",
                "shard_index",
                "batch_size",
                "fsync",
                "show_progress",
            )
        ),
    ),
]

EPILOG = """\
Multi-turn rows: turn k is generated after the regenerated turns before it; system and user
turns are kept. Each turn samples with a seed drawn from (--seed, row, turn). A killed run
resumes when started again with the same command: it regenerates exactly the batches of
--batch-size rows that the crash lost, so it ends with the bytes of an uninterrupted run.
Another job in the same --output-dir is refused. Rows that are not regenerated (prompt over
--max-prompt-tokens, server error, empty response, tool calls) are listed with the reason in
<output-dir>/failed.jsonl and counted at the end.
"""


def build_parser(prog: str = "speculators regenerate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Regenerate the assistant turns of chat data with the target model "
        "(on-policy training data).",
        epilog=EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flag_sources(parser, FLAG_SOURCES)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's start-up lines")
    return parser


def regenerate_options_from_args(args: argparse.Namespace) -> RegenerateOptions:
    target_config = fit_lengths_to_model(args)  # None where it read no config
    return RegenerateOptions(
        target_model_path=args.target_model_path,
        train_data_path=args.train_data_path,
        output_dir=args.output_dir,
        sampling=sampling_from_args(args),
        chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs),
        reasoning=args.reasoning,
        tool_rows=args.tool_rows,
        max_prompt_tokens=args.max_prompt_tokens,
        max_samples=args.max_samples,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        batch_size=args.batch_size,
        endpoint=args.endpoint,
        endpoint_model=args.endpoint_model,
        concurrency=args.concurrency,
        request_timeout=args.request_timeout,
        retries=args.retries,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        trust_remote_code=args.trust_remote_code,
        hf_cache_dir=args.hf_cache_dir,
        num_preprocessing_workers=args.num_preprocessing_workers,
        fsync=args.fsync,
        show_progress=not args.no_progress,
        target_config=target_config,
    )


def main(argv: Sequence[str] | None = None, prog: str = "speculators regenerate") -> int:
    args = build_parser(prog).parse_args(argv)
    if not args.verbose:
        keep_vllm_quiet()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def run() -> int:
        from dataclasses import asdict

        from speculators_vllm016.data_generation.regeneration.run import run_regeneration

        summary = run_regeneration(regenerate_options_from_args(args))
        print(f"Done: {summary.describe()}")
        print(f"SUMMARY {json.dumps(asdict(summary))}")
        return 0

    return report_errors(run, args.debug)
