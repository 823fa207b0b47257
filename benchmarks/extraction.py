"""Extraction throughput against its ceiling, in one command.

    python benchmarks/extraction.py --preset cpu-small --repeats 5 --plot

Runs, on the same token batches: (a) our hidden-state extraction end to end with sample files
written as `speculators datagen` writes them, (b) vLLM's own prefill (`LLM.generate`,
`max_tokens=1`) on the same engine settings, (c) transformers' forward with
`output_hidden_states=True` (the original EAGLE scripts' path). Prints the median tokens/s of each
and the ratios a/b and a/c, and writes JSON + markdown (+ a PNG with --plot) to --output-dir.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make `benchmarks` (and the repo's package) importable from the repo root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.presets import (  # noqa: E402
    OVERRIDABLE,
    PRESETS,
    SCHEDULES,
    BenchSettings,
    HardwareError,
    build_settings,
    check_hardware,
)

__all__ = ["main", "parse_args", "run"]

DEFAULT_KVCACHE_GIB = "1"
SETTLE_SECONDS = 3.5  # vLLM's shared-memory queues spin for 3 s after the last message
PRIME_TOKENS = 8


def _preset_help() -> str:
    return "; ".join(f"{name}: {preset.description}" for name, preset in PRESETS.items())


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/extraction.py",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Presets: " + _preset_help() + ".\n\nGPU presets check torch.cuda.device_count() "
            "against tensor_parallel_size x pipeline_parallel_size before starting anything. "
            "On vLLM's CPU build VLLM_CPU_KVCACHE_SPACE defaults to "
            f"{DEFAULT_KVCACHE_GIB} GiB here unless you set it."
        ),
    )
    parser.add_argument(
        "--preset",
        required=True,
        choices=sorted(PRESETS),
        help="which model, parallelism, engine limits and token batches to run (see below)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint path or hub id to benchmark; required by kimi-k2.5-8xrtxpro6000, "
        "replaces the default model of the other GPU presets and the tiny model of cpu presets",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per path; the median is reported (default: the preset's, 5 for "
        "cpu-small, 1 for smoke)",
    )
    parser.add_argument(
        "--output-dir",
        default="benchmarks/results",
        help="where extraction-<preset>.json/.md/.png go (default: benchmarks/results)",
    )
    parser.add_argument(
        "--plot",
        action="store_true",
        help="also write a PNG bar chart (needs matplotlib: pip install -r requirements/bench.txt)",
    )
    parser.add_argument(
        "--skip-hf",
        action="store_true",
        help="leave out (c), transformers' forward, for models too large for it (always left "
        "out by the Kimi preset)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="interleaved: all paths loaded side by side, runs alternate (a b c, b a c, ...) so "
        "drift hits all alike; sets VLLM_SLEEP_WHEN_IDLE=1 and pauses "
        f"{SETTLE_SECONDS} s before each run so idle engines do not spin. grouped: one engine at "
        "a time with all its repeats, for models that fit once or start in minutes (default: "
        "the preset's; GPU presets are grouped)",
    )
    parser.add_argument(
        "--samples-dir",
        default=None,
        help="where (a) and (c) write their sample files, deleted after each run (default: a "
        "temporary folder in --output-dir); put it on the disk datagen would write to",
    )
    tuning = parser.add_argument_group("overrides of the preset (recorded in the JSON)")
    tuning.add_argument(
        "--dtype", help="model dtype for all paths: auto, bfloat16, float16, float32"
    )
    tuning.add_argument(
        "--batch-size",
        type=int,
        help="sequences per generate() call in (a), as datagen's --batch-size",
    )
    tuning.add_argument("--max-num-seqs", type=int, help="vLLM max_num_seqs for (a) and (b)")
    tuning.add_argument(
        "--max-num-batched-tokens", type=int, help="vLLM max_num_batched_tokens for (a) and (b)"
    )
    tuning.add_argument("--max-model-len", type=int, help="vLLM max_model_len for (a) and (b)")
    tuning.add_argument(
        "--num-writer-threads", type=int, help="sample writer threads of (a) and (c)"
    )
    tuning.add_argument("--output-format", choices=("pt", "safetensors"), help="sample file format")
    tuning.add_argument(
        "--tensor-parallel-size", type=int, help="tensor parallel size for (a) and (b)"
    )
    tuning.add_argument(
        "--pipeline-parallel-size", type=int, help="pipeline parallel size for (a) and (b)"
    )
    return parser


def parse_args(argv: list[str] | None = None) -> BenchSettings:
    """Command line -> settings; errors exit with argparse's usage message."""
    parser = make_parser()
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in OVERRIDABLE}
    try:
        return build_settings(
            args.preset,
            model=args.model,
            repeats=args.repeats,
            skip_hf=args.skip_hf,
            schedule=args.schedule,
            output_dir=args.output_dir,
            plot=args.plot,
            samples_dir=args.samples_dir,
            **overrides,
        )
    except ValueError as error:
        parser.error(str(error))


def _say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def _measure(settings: BenchSettings, model: str, sequences: list[list[int]]):
    from benchmarks.paths import WARMUP_SEQUENCES, make_path

    samples_root = Path(settings.samples_dir or Path(settings.output_dir) / ".samples")
    keys = ["extraction", "vllm_prefill"] + ([] if settings.skip_hf else ["hf_forward"])
    warmup = sequences[:WARMUP_SEQUENCES]
    tokens = sum(map(len, sequences))
    measurements = []
    starts: dict[str, list[float]] = {key: [] for key in keys}

    def start(key: str):
        path = make_path(key, settings, model, samples_root)
        began = time.perf_counter()
        try:
            path.start(warmup)
        except BaseException:
            path.close()
            raise
        starts[key].append(round(time.perf_counter() - began, 2))
        _say(f"{key}: ready in {starts[key][-1]:.1f} s")
        return path

    def timed(path, repeat: int) -> None:
        measurement = path.run(sequences, repeat)
        measurements.append(measurement)
        _say(
            f"repeat {repeat + 1}/{settings.repeats} {measurement.path}: {tokens} tokens in "
            f"{measurement.seconds:.3f} s = {measurement.tokens_per_second:.0f} tokens/s"
        )

    if settings.schedule == "interleaved":
        paths = {}
        try:
            for key in keys:
                paths[key] = start(key)
            for repeat in range(settings.repeats):
                engines = keys[:2] if repeat % 2 == 0 else keys[1::-1]
                for key in engines + keys[2:]:
                    # Let the other engines' workers fall asleep (vLLM polls busily for 3 s
                    # after its last message), then wake this one: the run has the CPUs.
                    time.sleep(SETTLE_SECONDS)
                    paths[key].prime(sequences[0][:PRIME_TOKENS])
                    timed(paths[key], repeat)
        finally:
            for path in paths.values():
                path.close()
    else:
        for key in keys:
            path = start(key)
            try:
                for repeat in range(settings.repeats):
                    timed(path, repeat)
            finally:
                path.close()
    try:
        samples_root.rmdir()
    except OSError:
        pass
    return measurements, starts


def run(settings: BenchSettings, command: str) -> dict:
    """Check the hardware, build the inputs, measure every path and write the reports."""
    check_hardware(settings)  # before anything heavy starts
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB)
    if settings.schedule == "interleaved":
        # Engines loaded side by side: an idle one must not spin on a core while another runs.
        os.environ.setdefault("VLLM_SLEEP_WHEN_IDLE", "1")
    from benchmarks.environment import describe_environment
    from benchmarks.report import summarize, write_json, write_markdown, write_plot
    from benchmarks.workload import make_sequences, model_vocab_size, prepare_model

    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(settings, output_dir / ".models")
    sequences = make_sequences(settings.preset.workload, model_vocab_size(model))
    _say(
        f"preset {settings.preset.name}: {len(sequences)} sequences, "
        f"{sum(map(len, sequences))} tokens, model {model}, {settings.repeats} repeats"
    )
    environment = describe_environment()
    measurements, starts = _measure(settings, model, sequences)
    result = summarize(settings, measurements, environment, model, command, starts)

    stem = output_dir / f"extraction-{settings.preset.name}"
    write_json(result, stem.with_suffix(".json"))
    write_markdown(result, stem.with_suffix(".md"))
    written = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    if settings.plot:
        if write_plot(result, stem.with_suffix(".png")):
            written.append(stem.with_suffix(".png"))
        else:
            _say(
                "--plot: matplotlib is not installed, so no PNG was written "
                "(pip install -r requirements/bench.txt)"
            )
    medians = result["median_tokens_per_second"]
    for key, label in result["paths"].items():
        _say(f"median {label}: {medians[key]:.0f} tokens/s")
    for name, value in result["ratios"].items():
        _say(f"{name} = {value:.3f} (per repeat: {result['ratios_per_repeat'].get(name)})")
    _say("wrote " + ", ".join(str(path) for path in written))
    return result


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/extraction.py", *argv])
    try:
        run(settings, command)
    except HardwareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
