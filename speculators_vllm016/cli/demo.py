"""`speculators demo`: datagen on the embedded default, end to end, offline."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def build_parser(prog: str = "speculators demo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Build a tiny Llama locally and run datagen on the conversations shipped with the "
            "package (fully offline). Prints where the data went and the throughput."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--output-dir", default="output/demo", help="folder for the demo model and its data"
    )
    parser.add_argument(
        "--max-samples", type=int, default=None, help="conversations to use; None: all"
    )
    parser.add_argument("--seq-length", type=int, default=1024, help="truncate samples to this")
    parser.add_argument(
        "--batch-size", type=int, default=128, help="sequences per extraction call"
    )
    parser.add_argument(
        "--output-format", choices=["pt", "safetensors"], default="pt", help="sample file format"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "speculators demo") -> int:
    from speculators_vllm016.cli.datagen import report_errors
    from speculators_vllm016.data_generation.offline import DatagenOptions, run_datagen, summary_json
    from speculators_vllm016.demo import build_demo_model, demo_conversations_path

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(args.output_dir)
    model = build_demo_model(root / "model")
    options = DatagenOptions(
        target_model_path=str(model),
        train_data_path=str(demo_conversations_path()),
        output_dir=str(root / "data"),
        seq_length=args.seq_length,
        max_samples=args.max_samples,
        hf_cache_dir=str(root / "hf-datasets-cache"),
        batch_size=args.batch_size,
        output_format=args.output_format,
        num_preprocessing_workers=2,
        show_progress=not args.no_progress,
    )
    def run() -> int:
        summary = run_datagen(options)
        print(f"Demo model: {model}")
        print(f"Done: {summary.describe()}")
        print(f"SUMMARY {summary_json(summary)}")
        return 0

    return report_errors(run, args.debug)
