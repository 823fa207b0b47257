"""`speculators datagen`: the flags of 0.3.0's scripts/data_generation_offline.py, and more.

Parsed with argparse so that 0.3.0 invocations (`--layer-ids 2 16 29 31`) keep working.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from speculators_vllm016.data_generation.offline import DatagenOptions

__all__ = ["build_parser", "main", "options_from_args"]

EPILOG = """\
Sharding: run one process per machine with the same flags and --num-shards N --shard-index I;
shard I extracts rows I, I+N, I+2N, ... and names files by their global index, so the shards'
files together are exactly the unsharded run's. A killed run resumes where it stopped when started
again with the same command.
"""


def build_parser(prog: str = "speculators datagen") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Generate EAGLE-3 training data: target-model hidden states for chat data.",
        epilog=EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("target model")
    model.add_argument("--target-model-path", required=True, help="HF model id or local folder")
    model.add_argument("--tensor-parallel-size", type=int, default=1)
    model.add_argument("--pipeline-parallel-size", type=int, default=1)
    model.add_argument(
        "--max-model-len", type=int, default=None, help="default: --seq-length + 1"
    )
    model.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    model.add_argument("--dtype", default="auto", help="model dtype (auto, bfloat16, float32, ...)")
    model.add_argument("--max-num-seqs", type=int, default=None, help="default: max(32, batch)")
    model.add_argument("--max-num-batched-tokens", type=int, default=None)

    data = parser.add_argument_group("data")
    data.add_argument(
        "--train-data-path",
        required=True,
        help="local .json/.jsonl (ShareGPT or messages shape), or 'sharegpt' / 'ultrachat'",
    )
    data.add_argument("--seq-length", type=int, default=2048, help="truncate samples to this")
    data.add_argument("--max-samples", type=int, default=None)
    data.add_argument("--token-freq-path", default="./token_freq.pt")
    data.add_argument("--hf-cache-dir", default=None, help="datasets cache directory")
    data.add_argument(
        "--assistant-pattern",
        default=None,
        help="regex whose first group is assistant text (default: found from the chat template)",
    )
    data.add_argument(
        "--turn-dropout", action="store_true", help="keep a random prefix of each conversation"
    )
    data.add_argument("--seed", type=int, default=0, help="shuffle seed")
    data.add_argument("--num-preprocessing-workers", type=int, default=8)

    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", required=True)
    output.add_argument("--output-format", choices=["pt", "safetensors"], default="pt")
    output.add_argument("--start-idx", type=int, default=0, help="index of the first file")
    output.add_argument(
        "--layer-ids", type=int, nargs="+", default=None, help="default: [2, N/2, N-3, N-1]"
    )
    output.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help=(
            "sequences per extraction call (0.3.0 used 8). The engine runs a call's sequences "
            "continuously and samples are written as they finish, but each call ends with a "
            "partly filled step, so larger is faster; a resumed run recomputes whole calls"
        ),
    )
    output.add_argument("--num-shards", type=int, default=1)
    output.add_argument("--shard-index", type=int, default=0)
    output.add_argument("--num-writer-threads", type=int, default=4)
    output.add_argument(
        "--fsync",
        action="store_true",
        help="fsync every sample file (survives power loss; files are always whole after a crash)",
    )
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def options_from_args(args: argparse.Namespace) -> DatagenOptions:
    values = vars(args).copy()
    values["show_progress"] = not values.pop("no_progress")
    return DatagenOptions(**values)


def main(argv: Sequence[str] | None = None, prog: str = "speculators datagen") -> int:
    from speculators_vllm016.data_generation.offline import run_datagen, summary_json

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run_datagen(options_from_args(args))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Done: {summary.describe()}")
    print(f"SUMMARY {summary_json(summary)}")
    return 0
