"""Benchmark: on-policy data in two passes (`regenerate`, then `datagen`) against one pass
(`datagen --regenerate`), wall time of the whole commands, engine loads included.

    python benchmarks/regenerate_then_extract.py --repeats 3 [--model PATH] [--rows 64]

On the same rows (the demo's conversations) with the same flags, each repeat runs (a) `speculators
regenerate` and then `speculators datagen` on its output, two processes and two engine loads, and
(b) `speculators datagen --regenerate`, one process and one load, each into fresh folders, in
alternating order. It prints the median and the spread (min..max) of both and the ratio a/b, and
checks that (b) wrote the same sample files as (a). The saving is one engine load: seconds on a
tiny model, hours for a 1T-parameter target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.environment import describe_environment  # noqa: E402

DEMO_ROWS = ROOT / "speculators_vllm016" / "demo" / "conversations.jsonl"


def _run(argv: list[str]) -> float:
    command = [sys.executable, "-m", "speculators_vllm016", *argv, "--no-progress"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:1])} failed:\n{done.stderr[-3000:]}")
    return seconds


def _samples(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("data_*.pt"))}


def _two_pass(common, sampling, extraction, regen: Path, out: Path) -> float:
    """`speculators regenerate`, then `speculators datagen` on its output: two engine loads."""
    regenerate = ["regenerate", *common, *sampling, "--train-data-path", str(DEMO_ROWS)]
    first = _run([*regenerate, "--output-dir", str(regen)])
    data = str(regen / "conversations.jsonl")
    datagen = ["datagen", *common, *extraction, "--train-data-path", data]
    return first + _run([*datagen, "--output-dir", str(out)])


def _one_pass(common, sampling, extraction, out: Path) -> float:
    """`speculators datagen --regenerate`: one engine load."""
    datagen = ["datagen", *common, *extraction, "--train-data-path", str(DEMO_ROWS)]
    return _run([*datagen, "--regenerate", *sampling, "--output-dir", str(out)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target folder; None: the tiny Llama")
    parser.add_argument("--rows", type=int, default=64, help="demo conversations used")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per regenerated turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    model = args.model
    if model is None:
        from speculators_vllm016.tiny_models import build_tiny_llama

        model = str(build_tiny_llama(work / "llama"))
    common = [
        "--target-model-path", model, "--max-samples", str(args.rows), "--dtype", "float32",
    ]  # fmt: skip
    sampling = ["--temperature", "0", "--max-tokens", str(args.max_tokens)]
    sampling += ["--max-prompt-tokens", "768"]  # the demo rows are short; the tiny model has 1024
    extraction = ["--seq-length", "1000", "--num-preprocessing-workers", "1"]
    times: dict[str, list[float]] = {"two_pass": [], "one_pass": []}
    for repeat in range(args.repeats):
        run = work / f"run{repeat}"
        regen, two, one = run / "regen", run / "two", run / "one"

        passes = {
            "two_pass": (_two_pass, (common, sampling, extraction, regen, two)),
            "one_pass": (_one_pass, (common, sampling, extraction, one)),
        }
        order = ["two_pass", "one_pass"]
        for name in order if repeat % 2 == 0 else reversed(order):
            timed, arguments = passes[name]
            times[name].append(timed(*arguments))
            print(f"repeat {repeat} {name}: {times[name][-1]:.1f} s", flush=True)
        if _samples(one) != _samples(two) or not _samples(one):
            raise SystemExit(f"repeat {repeat}: the one-pass samples differ from the two-pass ones")
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{'':10} {'median s':>9} {'min..max s':>16}")
    for name, values in times.items():
        print(f"{name:10} {medians[name]:9.1f} {min(values):7.1f}..{max(values):<7.1f}")
    ratio = medians["two_pass"] / medians["one_pass"]
    print(f"two-pass / one-pass (medians): {ratio:.2f}x; samples equal in every repeat")
    if args.output:
        result = {"rows": args.rows, "max_tokens": args.max_tokens, "model": model,
                  "seconds": times, "medians": medians, "ratio": ratio,
                  "environment": describe_environment()}  # fmt: skip
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
