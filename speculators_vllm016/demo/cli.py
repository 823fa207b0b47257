"""`speculators demo`: the main job end to end on a tiny local model, offline, on the CPU.

The demo's own command line (the top of the package: `__main__` dispatches to it); the stages
are `demo.pipeline`'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from speculators_vllm016.demo.engine_dtype import ENGINE_DTYPES
from speculators_vllm016.demo.pipeline import DemoOptions, DemoResult

__all__ = ["build_parser", "main", "options_from_args", "print_summary", "work_offline"]


def build_parser(prog: str = "speculators demo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "The whole job on a tiny Llama built locally and the conversations shipped with the "
            "package, fully offline: train the target briefly, extract hidden states, build the "
            "vocabulary maps, train an EAGLE-3 draft, and measure the untrained and the trained "
            "draft's acceptance side by side. Run again, a stage is reused if its options are "
            "unchanged; a stage whose options changed runs again, with every stage after it."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--output-dir", default="output/demo", help="folder for everything the demo writes"
    )
    parser.add_argument(
        "--max-samples",
        type=int,
        default=160,
        help="conversations for datagen (the package ships 320)",
    )
    parser.add_argument("--seq-length", type=int, default=1024, help="truncate samples to this")
    parser.add_argument("--batch-size", type=int, default=128, help="sequences per extraction call")
    parser.add_argument(
        "--output-format", choices=["pt", "safetensors"], default="pt", help="sample file format"
    )
    parser.add_argument("--target-steps", type=int, default=40, help="training steps of the target")
    parser.add_argument(
        "--target-row-tokens", type=int, default=128, help="tokens per target training row"
    )
    parser.add_argument("--target-rows-per-step", type=int, default=8, help="rows per target step")
    parser.add_argument(
        "--draft-vocab-size", type=int, default=512, help="tokens the draft predicts"
    )
    parser.add_argument("--epochs", type=int, default=2, help="draft training epochs")
    parser.add_argument("--lr", type=float, default=1e-3, help="draft learning rate")
    parser.add_argument(
        "--total-seq-len", type=int, default=2048, help="tokens per packed draft row"
    )
    parser.add_argument("--eval-prompts", type=int, default=24, help="prompts for the evaluation")
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens generated per prompt"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds every stage")
    parser.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default="auto",
        help="the extraction engine's dtype; auto: vLLM's choice (bfloat16 for this "
        "model) where the CPU computes bfloat16 natively, float32 where it "
        "would be emulated (about 5x slower)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """The demo's options from its parsed command line (`--debug` is the command's own)."""
    values = vars(args).copy()
    values.pop("debug", None)
    values["show_progress"] = not values.pop("no_progress")
    return DemoOptions(**values)


def print_summary(result: DemoResult) -> None:
    """Where everything went, the time of each stage, throughputs, and tau before and after."""
    print("\n== speculators demo: summary ==")
    print(f"output folder: {result.root}")
    for stage in result.stages:
        reused = " (reused from an earlier run)" if stage.reused else ""
        print(f"  {stage.name:<14} {stage.seconds:7.1f} s{reused}")
        for name, path in stage.outputs.items():
            print(f"      {name}: {path}")
    target, datagen, train, evaluation = (
        result.stage("target"),
        result.stage("datagen"),
        result.stage("train"),
        result.stage("eval"),
    )
    print(
        f"target training: loss {target.figures['first_loss']:.3f} -> {target.figures['last_loss']:.3f}, "
        f"{target.figures['tokens_per_second']:.0f} tokens/s"
    )
    print(
        f"extraction: {datagen.figures['samples']} samples, {datagen.figures['tokens']} tokens, "
        f"{datagen.figures['tokens_per_second']:.0f} tokens/s"
    )
    first, last = train.figures["first_loss"], train.figures["last_loss"]
    losses = f"loss {first:.3f} -> {last:.3f}, " if first is not None and last is not None else ""
    print(
        f"draft training: {train.figures['steps']} steps, {losses}"
        f"{train.figures['tokens_per_second']:.0f} tokens/s"
    )
    print(f"acceptance on {evaluation.figures['prompts']} prompts (hf engine, greedy):")
    print(evaluation.figures["table"])
    before, after = evaluation.figures["tau_untrained"], evaluation.figures["tau_trained"]
    print(f"tau: untrained {before:.3f} -> trained {after:.3f}")
    print(f"total: {sum(s.seconds for s in result.stages):.1f} s")


def work_offline() -> None:
    """The demo never needs the hub: say so to huggingface_hub (and so transformers), unless the
    user's environment says otherwise. The hub reads `HF_HUB_OFFLINE` once, when first imported,
    and the command line may have imported it already: then its setting is changed too."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None and os.environ["HF_HUB_OFFLINE"].lower() in ("1", "true", "yes", "on"):
        constants.HF_HUB_OFFLINE = True


def main(argv: Sequence[str] | None = None, prog: str = "speculators demo") -> int:
    work_offline()
    from speculators_vllm016.demo.pipeline import run_demo
    from speculators_vllm016.utils.command_errors import report_errors

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    options = options_from_args(args)

    def run() -> int:
        print_summary(run_demo(options))
        return 0

    return report_errors(run, args.debug)
