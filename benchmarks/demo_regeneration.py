"""Benchmark: does the demo's draft gain from on-policy data? tau of the untrained draft, the
draft trained on the shipped conversations and the one trained on their regenerated version;
and, from the serve stage, vLLM's own tau of both trained drafts at short and at ~1,750-token
prompts with long / short (#46).

    python benchmarks/demo_regeneration.py --seeds 0 1 2 \
        --output benchmarks/results/demo-regeneration-tiny-cpu-<yyyymmdd>.json

Each seed is one default `speculators demo --seed N` (its own target, data, drafts), run as a
separate process into its own folder (`--jobs` of them at once); extra demo flags go after `--`. The taus and the seconds
of every stage are read from the run's `demo_state.json`. It prints a table (per seed, then the
median with min..max of each tau and of the regenerated-minus-shipped gap) and the served taus
and writes them, with the environment, as JSON. `--baseline-dir` reads finished runs of another
version (seedN folders, e.g. the previous default demo's, run on the same machine) into the same
file, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.environment import describe_environment  # noqa: E402

DRAFTS = ("untrained", "shipped", "regenerated")


def run_seed(seed: int, folder: Path, extra: list[str]) -> dict:
    """One demo run into `folder` (its output in `seed<N>.log` beside it); its figures."""
    command = [sys.executable, "-m", "speculators_vllm016", "demo", "--output-dir", str(folder)]
    command += ["--seed", str(seed), "--no-progress", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (folder.parent / f"seed{seed}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"demo --seed {seed} failed:\n{done.stderr[-3000:]}")
    return read_run(seed, folder, wall)


def read_run(seed: int, folder: Path, wall: float | None) -> dict:
    """A finished demo run's taus, stage seconds and the held-out rows it evaluated on."""
    state = json.loads((folder / "demo_state.json").read_text())
    figures = state["eval"]["figures"]
    return {
        "seed": seed,
        "tau": {draft: figures[f"tau_{draft}"] for draft in DRAFTS},
        "rates": {draft: figures[f"rates_{draft}"] for draft in DRAFTS},
        "prompts": figures["prompts"],
        "held_out_rows": state["split"]["figures"]["held_out_rows"][: figures["prompts"]],
        "regeneration": state["regen datagen"]["figures"],
        "served": served_figures(state.get("serve", {}).get("figures", {})),
        "target": state["target"]["figures"],
        "stage_seconds": {name: entry["seconds"] for name, entry in state.items()},
        "wall_seconds": wall,
    }


def served_figures(figures: dict) -> dict:
    """The serve stage's tau by vLLM's counters per trained draft, short and long, and how many
    outputs equal plain greedy (empty where the run served nothing)."""
    served: dict = {"long_prompt_tokens": figures.get("long_prompt_tokens")}
    for draft in DRAFTS[1:]:
        if f"vllm_tau_{draft}" in figures:
            served[draft] = {
                "tau_short": figures[f"vllm_tau_{draft}"],
                "tau_long": figures.get(f"vllm_tau_long_{draft}"),
                "long_over_short": figures.get(f"long_over_short_{draft}"),
                "lossless": figures[f"lossless_{draft}"],
                "lossless_long": figures.get(f"lossless_long_{draft}"),
            }
    return served


def format_served(runs: list[dict]) -> str:
    """Per seed: each trained draft's vLLM tau short / long (long/short), regenerations empty,
    target and total seconds."""
    lines = [
        "| seed | shipped short / long (ratio) | regenerated short / long (ratio) | "
        "not regenerated | target s | total s |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        cells = []
        for draft in DRAFTS[1:]:
            figures = run["served"].get(draft)
            cells.append(
                "-"
                if not figures or figures["tau_long"] is None
                else f"{figures['tau_short']:.2f} / {figures['tau_long']:.2f} "
                f"({figures['long_over_short']:.2f})"
            )
        seconds = run["stage_seconds"]
        lines.append(
            f"| {run['seed']} | {' | '.join(cells)} | {run['regeneration']['not_regenerated']} | "
            f"{seconds['target']:.0f} | {sum(seconds.values()):.0f} |"
        )
    return "\n".join(lines)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Median and range over the seeds of each tau and of the regenerated - shipped gap."""
    summary = {draft: _spread([run["tau"][draft] for run in runs]) for draft in DRAFTS}
    summary["regenerated_minus_shipped"] = _spread(
        [run["tau"]["regenerated"] - run["tau"]["shipped"] for run in runs]
    )
    return summary


def format_table(runs: list[dict], summary: dict[str, dict[str, float]]) -> str:
    lines = [
        "| seed | tau untrained | tau shipped | tau regenerated | regenerated - shipped |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        tau = run["tau"]
        gap = tau["regenerated"] - tau["shipped"]
        lines.append(
            f"| {run['seed']} | {tau['untrained']:.3f} | {tau['shipped']:.3f} | "
            f"{tau['regenerated']:.3f} | {gap:+.3f} |"
        )
    cells = []
    for name in (*DRAFTS, "regenerated_minus_shipped"):
        s = summary[name]
        sign = "+" if name == "regenerated_minus_shipped" else ""
        cells.append(f"{s['median']:{sign}.3f} ({s['min']:{sign}.3f}..{s['max']:{sign}.3f})")
    lines.append(f"| median (min..max) | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--jobs", type=int, default=1, help="seeds run at once (stage times then share the CPU)"
    )
    parser.add_argument("--work-dir", default=None, help="demo folders go here (default: a temp)")
    parser.add_argument("--output", default=None, help="also write the figures here (JSON)")
    parser.add_argument(
        "--read-only",
        action="store_true",
        help="run nothing: read the finished runs in --work-dir (e.g. after an interrupted call)",
    )
    parser.add_argument(
        "--baseline-dir",
        default=None,
        help="also read the finished runs (seedN folders) of another version here, side by side",
    )
    parser.add_argument("demo_args", nargs="*", help="extra `speculators demo` flags, after --")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="demo-regen-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    def one(seed: int) -> dict:
        folder = work / f"seed{seed}"
        run = (
            read_run(seed, folder, None)
            if args.read_only
            else run_seed(seed, folder, args.demo_args)
        )
        tau = run["tau"]
        print(
            f"seed {seed}: tau untrained {tau['untrained']:.3f}, shipped {tau['shipped']:.3f}, "
            f"regenerated {tau['regenerated']:.3f}",
            flush=True,
        )
        return run

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(one, args.seeds))
    summary = summarise(runs)
    print(format_table(runs, summary))
    print(format_served(runs))
    baseline = None
    if args.baseline_dir:
        folder = Path(args.baseline_dir)
        baseline = [read_run(seed, folder / f"seed{seed}", None) for seed in args.seeds]
        print(f"baseline ({folder}):")
        print(format_table(baseline, summarise(baseline)))
        print(format_served(baseline))
    if args.output:
        result = {
            "command": "speculators demo --seed N" + "".join(f" {a}" for a in args.demo_args),
            "seeds_at_once": args.jobs,
            "runs": runs,
            "summary": summary,
            "baseline": baseline,
            "environment": describe_environment(),
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
