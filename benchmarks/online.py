"""Online vs offline training, side by side: wall time to the same checkpoint, bytes on disk.

    python benchmarks/online.py --preset cpu-small [--repeats 3] [--epochs 2] [--rows 48]

offline = `speculators datagen` (hidden states to files) + `speculators train --data-path` on them;
online  = `speculators train --online` (hidden states extracted live, nothing but checkpoints on
disk). Both train the same draft from the same chat rows (the shipped demo conversations) with
the same flags; the script checks that the two final checkpoints are bit-identical, so the times
are times to the same result. Each command runs in a fresh interpreter and is timed whole
(engine start-up included, as a user sees it). Bytes are the files each way leaves on disk:
offline's data folder and checkpoints, online's checkpoints. The preset's model (cpu-small: a
56M-parameter Llama) is built locally with a chat tokenizer. JSON and markdown go to
--output-dir.
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
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file()) if path.exists() else 0


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
        raise SystemExit(f"--preset {preset_name} has no locally built model; use cpu-small or smoke")
    return build_tiny_llama(
        where, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
    )


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
    args = parser.parse_args(argv)

    from benchmarks.presets import PRESETS
    from speculators_vllm016.demo import demo_conversations_path

    preset = PRESETS[args.preset]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="online-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_model(args.preset, work / "model")
    chats = work / "chats.jsonl"
    chats.write_text("\n".join(demo_conversations_path().read_text().splitlines()[: args.rows]) + "\n")
    speculators = [sys.executable, "-m", "speculators_vllm016"]
    shared = ["--seq-length", str(args.seq_length), "--dtype", preset.dtype,
              "--hf-cache-dir", str(work / "hf"), "--num-preprocessing-workers", "1"]
    runs: list[Run] = []
    same: list[bool] = []
    for repeat in range(args.repeats):
        data, offline_save, online_save = (work / f"{name}-{repeat}" for name in ("data", "offline", "online"))
        datagen_s = timed([*speculators, "datagen", "--target-model-path", str(model),
                           "--train-data-path", str(chats), "--output-dir", str(data),
                           "--no-progress", *shared], env)
        train = ["--verifier-name-or-path", str(model), "--draft-vocab-size", "1024",
                 "--total-seq-len", str(args.total_seq_len), "--epochs", str(args.epochs),
                 "--num-workers", "0", "--no-progress", "--precision", "fp32", "--device", "cpu",
                 "--log-dir", str(work / "logs")]
        counts = ["--token-freq-path", str(data / "token_freq" / "shard-0-of-1.pth")]
        train_s = timed([*speculators, "train", *train, *counts, "--data-path", str(data),
                         "--save-path", str(offline_save)], env)
        runs.append(Run("offline", datagen_s + train_s, datagen_s, train_s, folder_bytes(data),
                        folder_bytes(offline_save)))
        online_s = timed([*speculators, "train", *train, *counts, "--online",
                          "--train-data-path", str(chats), "--save-path", str(online_save), *shared],
                         env)
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
        "preset": args.preset, "rows": args.rows, "seq_length": args.seq_length,
        "epochs": args.epochs, "repeats": args.repeats, "cpus": os.cpu_count(),
        "same_final_checkpoint": all(same), "runs": [asdict(run) for run in runs],
        "offline": summary("offline"), "online": summary("online"),
    }
    result["online_over_offline_time"] = (
        result["online"]["median_seconds"] / result["offline"]["median_seconds"]
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"online-{args.preset}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# online vs offline training, {args.preset}", "",
        f"{args.rows} chat rows, seq-length {args.seq_length}, {args.epochs} epochs, "
        f"{args.repeats} repeat(s); same final checkpoint: {result['same_final_checkpoint']}", "",
        "| way | wall s (median) | spread | hidden-state bytes on disk | checkpoint bytes |",
        "|---|---|---|---|---|",
    ]
    for way in ("offline", "online"):
        row = result[way]
        lines.append(f"| {way} | {row['median_seconds']:.1f} | {row['spread_seconds'][0]:.1f}.."
                     f"{row['spread_seconds'][1]:.1f} | {row['data_bytes']:,} | {row['checkpoint_bytes']:,} |")
    lines.append("")
    lines.append(f"online / offline wall time: {result['online_over_offline_time']:.2f}")
    (out / f"online-{args.preset}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["same_final_checkpoint"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
