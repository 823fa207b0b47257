"""Online vs offline training, side by side: wall time to the same checkpoint, bytes on disk.

    python benchmarks/online.py --preset cpu-small [--repeats 3] [--epochs 2] [--rows 48]
    python benchmarks/online.py --preset cpu-small --split 1:2 2:2   # extraction ranks apart

offline = `speculators datagen` (hidden states to files) + `speculators train --data-path` on them;
online  = `speculators train --online` (hidden states extracted live, nothing but checkpoints on
disk). Both train the same draft from the same chat rows (the shipped demo conversations) with
the same flags; the script checks that the two final checkpoints are bit-identical, so the times
are times to the same result. Each command runs in a fresh interpreter and is timed whole
(engine start-up included, as a user sees it). Bytes are the files each way leaves on disk:
offline's data folder and checkpoints, online's checkpoints. The preset's model (cpu-small: a
56M-parameter Llama) is built locally with a chat tokenizer. JSON and markdown go to
--output-dir.

`--split K:T` runs the split layout instead (`torchrun` with K + T processes, `train --online
--extraction-ranks K`) beside offline training with T ranks on datagen's files of the same rows,
and reports per layout: wall time, extraction tokens/s (each extraction rank's extracted tokens
over its seconds inside the engine, summed), training tokens/s (the trainer's tokens over its step
times), hidden-state bytes moved and their rate, and who waited (the training ranks for rows, the
extraction ranks for room in their queue and for requests). Written to `online-split-<preset>.*`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    way: str  # "offline" or "online"
    seconds: float  # whole wall time: datagen + train, or train --online
    datagen_seconds: float
    train_seconds: float
    data_bytes: int  # hidden-state files left on disk
    checkpoint_bytes: int


def folder_bytes(path: Path) -> int:
    return (
        sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
        if path.exists()
        else 0
    )


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return elapsed


def build_model(preset_name: str, where: Path) -> Path:
    from benchmarks.presets import PRESETS
    from speculators_vllm016.tiny_models import build_tiny_llama

    spec = PRESETS[preset_name].tiny_model
    if spec is None:
        raise SystemExit(
            f"--preset {preset_name} has no locally built model; use cpu-small or smoke"
        )
    return build_tiny_llama(
        where,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
    )


def write_report(folder: Path, stem: str, result: dict, lines: list[str]) -> None:
    """`<stem>.json` (the figures) and `<stem>.md` (the table) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (folder / f"{stem}.md").write_text("\n".join(lines) + "\n")


def final_weights_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-small", help="a preset with a locally built model")
    parser.add_argument("--rows", type=int, default=48, help="chat rows (demo conversations)")
    parser.add_argument("--seq-length", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--total-seq-len", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each way (median, spread)")
    parser.add_argument("--output-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--work-dir", default=None, help="default: a temporary folder, removed")
    parser.add_argument(
        "--split",
        nargs="+",
        default=None,
        metavar="K:T",
        help="extraction ranks : training ranks layouts to run under torchrun",
    )
    args = parser.parse_args(argv)

    from benchmarks.presets import PRESETS
    from speculators_vllm016.demo import demo_conversations_path

    preset = PRESETS[args.preset]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="online-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_model(args.preset, work / "model")
    chats = work / "chats.jsonl"
    chats.write_text(
        "\n".join(demo_conversations_path().read_text().splitlines()[: args.rows]) + "\n"
    )
    speculators = [sys.executable, "-m", "speculators_vllm016"]
    shared = [
        "--seq-length",
        str(args.seq_length),
        "--dtype",
        preset.dtype,
        "--hf-cache-dir",
        str(work / "hf"),
        "--num-preprocessing-workers",
        "1",
    ]
    if args.split:
        return run_split_layouts(args, preset, work, model, chats, speculators, shared, env)
    runs: list[Run] = []
    same: list[bool] = []
    for repeat in range(args.repeats):
        data, offline_save, online_save = (
            work / f"{name}-{repeat}" for name in ("data", "offline", "online")
        )
        datagen_s = timed(
            [
                *speculators,
                "datagen",
                "--target-model-path",
                str(model),
                "--train-data-path",
                str(chats),
                "--output-dir",
                str(data),
                "--no-progress",
                *shared,
            ],
            env,
        )
        train = [
            "--verifier-name-or-path",
            str(model),
            "--draft-vocab-size",
            "1024",
            "--total-seq-len",
            str(args.total_seq_len),
            "--epochs",
            str(args.epochs),
            "--num-workers",
            "0",
            "--no-progress",
            "--precision",
            "fp32",
            "--device",
            "cpu",
            "--log-dir",
            str(work / "logs"),
        ]
        counts = ["--token-freq-path", str(data / "token_freq" / "shard-0-of-1.pth")]
        train_s = timed(
            [
                *speculators,
                "train",
                *train,
                *counts,
                "--data-path",
                str(data),
                "--save-path",
                str(offline_save),
            ],
            env,
        )
        runs.append(
            Run(
                "offline",
                datagen_s + train_s,
                datagen_s,
                train_s,
                folder_bytes(data),
                folder_bytes(offline_save),
            )
        )
        online_s = timed(
            [
                *speculators,
                "train",
                *train,
                *counts,
                "--online",
                "--train-data-path",
                str(chats),
                "--save-path",
                str(online_save),
                *shared,
            ],
            env,
        )
        runs.append(Run("online", online_s, 0.0, online_s, 0, folder_bytes(online_save)))
        last = str(args.epochs - 1)
        same.append(final_weights_equal(offline_save / last, online_save / last))

    def summary(way: str) -> dict:
        chosen = [run for run in runs if run.way == way]
        seconds = [run.seconds for run in chosen]
        return {
            "median_seconds": statistics.median(seconds),
            "spread_seconds": [min(seconds), max(seconds)],
            "data_bytes": chosen[0].data_bytes,
            "checkpoint_bytes": chosen[0].checkpoint_bytes,
        }

    result = {
        "preset": args.preset,
        "rows": args.rows,
        "seq_length": args.seq_length,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "same_final_checkpoint": all(same),
        "runs": [asdict(run) for run in runs],
        "offline": summary("offline"),
        "online": summary("online"),
    }
    result["online_over_offline_time"] = (
        result["online"]["median_seconds"] / result["offline"]["median_seconds"]
    )
    lines = [
        f"# online vs offline training, {args.preset}",
        "",
        f"{args.rows} chat rows, seq-length {args.seq_length}, {args.epochs} epochs, "
        f"{args.repeats} repeat(s); same final checkpoint: {result['same_final_checkpoint']}",
        "",
        "| way | wall s (median) | spread | hidden-state bytes on disk | checkpoint bytes |",
        "|---|---|---|---|---|",
    ]
    for way in ("offline", "online"):
        row = result[way]
        lines.append(
            f"| {way} | {row['median_seconds']:.1f} | {row['spread_seconds'][0]:.1f}.."
            f"{row['spread_seconds'][1]:.1f} | {row['data_bytes']:,} | {row['checkpoint_bytes']:,} |"
        )
    lines.append("")
    lines.append(f"online / offline wall time: {result['online_over_offline_time']:.2f}")
    write_report(Path(args.output_dir), f"online-{args.preset}", result, lines)
    print("\n".join(lines))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["same_final_checkpoint"] else 1


def _torchrun(processes: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "speculators_vllm016",
    ]


def _split_figures(log: str, metrics: Path) -> dict:
    """Extraction ranks' summary lines and the training ranks' metrics log, as figures."""
    from speculators_vllm016.train.metrics_log import read_metrics
    from speculators_vllm016.train.online.extraction_rank import SUMMARY_PREFIX

    ranks = [
        json.loads(line.split(SUMMARY_PREFIX, 1)[1])
        for line in log.splitlines()
        if SUMMARY_PREFIX in line
    ]
    steps = [r.train for r in read_metrics(metrics) if r.train is not None]
    timed = steps[1:] or steps  # the first step compiles nothing on the CPU, but warms caches
    tokens, seconds = sum(s["tokens"] for s in timed), sum(s["step_seconds"] for s in timed)
    sent = sum(rank["bytes_sent"] for rank in ranks)
    wall = max((rank["seconds"] for rank in ranks), default=0.0)
    return {
        "extraction_tokens_per_second": sum(
            rank["extracted_tokens"] / rank["extraction_seconds"]
            for rank in ranks
            if rank["extraction_seconds"]
        ),
        "training_tokens_per_second": tokens / seconds if seconds else None,
        "bytes_moved": sent,
        "bytes_per_second": sent / wall if wall else None,
        "training_ranks_waited_seconds": sum(s.get("data_wait_seconds", 0.0) for s in steps),
        "extraction_ranks_waited_for_room_seconds": sum(
            r["waited_for_room_seconds"] for r in ranks
        ),
        "extraction_ranks_waited_for_requests_seconds": sum(
            r["waited_for_requests_seconds"] for r in ranks
        ),
        "extraction_ranks": ranks,
    }


def run_split_layouts(
    args: argparse.Namespace,
    preset: object,
    work: Path,
    model: Path,
    chats: Path,
    speculators: list[str],
    shared: list[str],
    env: dict[str, str],
) -> int:
    """`--split K:T ...`: each layout beside offline training with T ranks (same final weights)."""
    data = work / "data"
    datagen_s = timed(
        [
            *speculators,
            "datagen",
            "--target-model-path",
            str(model),
            "--train-data-path",
            str(chats),
            "--output-dir",
            str(data),
            "--no-progress",
            *shared,
        ],
        env,
    )
    train = [
        "--verifier-name-or-path",
        str(model),
        "--draft-vocab-size",
        "1024",
        "--total-seq-len",
        str(args.total_seq_len),
        "--epochs",
        str(args.epochs),
        "--num-workers",
        "0",
        "--no-progress",
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--parallel",
        "ddp",
        "--log-dir",
        str(work / "logs"),
        "--token-freq-path",
        str(data / "token_freq" / "shard-0-of-1.pth"),
    ]
    layouts, offline = [], {}
    for layout in args.split:
        k, t = (int(part) for part in layout.split(":"))
        if t not in offline:
            save = work / f"offline-{t}"
            offline[t] = (
                save,
                timed(
                    [
                        *_torchrun(t),
                        "train",
                        *train,
                        "--data-path",
                        str(data),
                        "--save-path",
                        str(save),
                    ],
                    env,
                ),
            )
        save = work / f"split-{k}-{t}"
        command = [
            *_torchrun(k + t),
            "train",
            *train,
            "--online",
            "--extraction-ranks",
            str(k),
            "--train-data-path",
            str(chats),
            "--save-path",
            str(save),
            *shared,
        ]
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(
                f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}"
            )
        last = str(args.epochs - 1)
        layouts.append(
            {
                "layout": layout,
                "extraction_ranks": k,
                "training_ranks": t,
                "wall_seconds": seconds,
                "offline_train_seconds": offline[t][1],
                "offline_datagen_seconds": datagen_s,
                "same_final_checkpoint_as_offline": final_weights_equal(
                    offline[t][0] / last, save / last
                ),
                **_split_figures(done.stdout + done.stderr, save / "metrics.jsonl"),
            }
        )
    result = {
        "preset": args.preset,
        "rows": args.rows,
        "seq_length": args.seq_length,
        "epochs": args.epochs,
        "cpus": os.cpu_count(),
        "layouts": layouts,
    }
    lines = [
        f"# online training, extraction ranks apart from training ranks, {args.preset}",
        "",
        f"{args.rows} chat rows, seq-length {args.seq_length}, {args.epochs} epochs, {os.cpu_count()} CPUs "
        "shared by every rank (extraction and training compete for them here: figures for the "
        "mechanism, not for a GPU node)",
        "",
        "| K:T | wall s | offline: datagen + train s | extraction tok/s | training tok/s | MB moved | MB/s "
        "| trainers waited s | extractors waited for room / requests s | same weights as offline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in layouts:
        training = row["training_tokens_per_second"] or 0.0
        rate = row["bytes_per_second"] or 0.0
        lines.append(
            f"| {row['layout']} | {row['wall_seconds']:.1f} | {row['offline_datagen_seconds']:.1f} + "
            f"{row['offline_train_seconds']:.1f} | {row['extraction_tokens_per_second']:,.0f} | {training:,.0f} | "
            f"{row['bytes_moved'] / 1e6:,.1f} | {rate / 1e6:,.2f} | {row['training_ranks_waited_seconds']:.1f} | "
            f"{row['extraction_ranks_waited_for_room_seconds']:.1f} / "
            f"{row['extraction_ranks_waited_for_requests_seconds']:.1f} | {row['same_final_checkpoint_as_offline']} |"
        )
    write_report(Path(args.output_dir), f"online-split-{args.preset}", result, lines)
    print("\n".join(lines))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(row["same_final_checkpoint_as_offline"] for row in layouts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
