"""`speculators regenerate`: chat data with every assistant turn answered by the target itself.

The output is a JSONL of `messages` rows that `speculators datagen --train-data-path` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

from speculators_vllm016.cli.datagen import keep_vllm_quiet
from speculators_vllm016.cli.regeneration_flags import (
    add_regeneration_arguments,
    fit_lengths_to_model,
    sampling_from_args,
)
from speculators_vllm016.data_generation.options import DTYPES, parse_template_kwargs
from speculators_vllm016.data_generation.regeneration.options import RegenerateOptions
from speculators_vllm016.utils.command_errors import report_errors

__all__ = ["build_parser", "main", "regenerate_options_from_args"]

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
    model = parser.add_argument_group("target model")
    model.add_argument("--target-model-path", required=True, help="HF model id or local folder")
    model.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model copy")
    model.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages")
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine context; None: --max-prompt-tokens + --max-tokens (their defaults are "
        "lowered to fit the model's context)",
    )
    model.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM's share")
    model.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype")
    model.add_argument("--max-num-seqs", type=int, default=256, help="engine batch")
    model.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run Python code shipped in the model folder (e.g. Kimi-K2.5's tokenizer)",
    )
    endpoint = parser.add_argument_group("server (instead of the in-process engine)")
    endpoint.add_argument(
        "--endpoint",
        default=None,
        help="base URL of a running OpenAI-compatible server (e.g. vllm serve) to ask instead; "
        "--target-model-path still gives the tokenizer and chat template",
    )
    endpoint.add_argument("--endpoint-model", default=None, help="served model name (if several)")
    endpoint.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    endpoint.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    endpoint.add_argument("--retries", type=int, default=4, help="retries with backoff")

    data = parser.add_argument_group("data")
    data.add_argument(
        "--train-data-path",
        required=True,
        help="local .json/.jsonl (ShareGPT or messages shape), or 'sharegpt' / 'ultrachat'",
    )
    data.add_argument("--max-samples", type=int, default=None, help="the first N rows; None: all")
    data.add_argument("--hf-cache-dir", default=None, help="datasets cache directory")
    data.add_argument("--num-preprocessing-workers", type=int, default=8, help="loader processes")
    add_regeneration_arguments(parser.add_argument_group("regeneration"))

    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", required=True, help="folder for conversations.jsonl")
    output.add_argument("--num-shards", type=int, default=1, help="shards of the whole job")
    output.add_argument("--shard-index", type=int, default=0, help="this process's shard")
    output.add_argument(
        "--batch-size", type=int, default=256, help="rows generated together (a crash loses these)"
    )
    output.add_argument("--fsync", action="store_true", help="fsync every finished row")
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's start-up lines")
    return parser


def regenerate_options_from_args(args: argparse.Namespace) -> RegenerateOptions:
    fit_lengths_to_model(args)
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
