"""The real trainer (`speculators train`) on sample files, against the step benchmark.

    python benchmarks/trainer_gpu.py --preset llama-3.1-8b-draft --runs single ddp fsdp

Writes synthetic sample files in datagen's layout (`write_sample`: bf16 hidden states of 4
captured layers, `--sample-tokens` per sample) and a small synthetic verifier folder (config,
embeddings, final norm and LM head only: what the draft loads), then runs `speculators train` on
them for `--max-steps` steps: `single` in one process on the first device, `ddp` and `fsdp` under
torchrun on `--gpus` devices. Throughput comes from the trainer's own `metrics.jsonl`
(`train/tokens` over `train/step_seconds`, the wall clock between step ends, waiting for data
included); the first `--warmup-steps` steps (compilation) are left out; median and spread per
step, and the total tokens over the total seconds of the timed steps. `--step-benchmark` also runs
`benchmarks/training.py` on the same shapes in this run, for the ratio trainer / step benchmark.
Each run's last checkpoint write is timed (the trainer's log). `--resume-check` runs each kind
twice more: half the steps, then the same command resumed to the end; it reports the checkpoint
load time and whether the resumed run's final weights equal the uninterrupted run's, bit for bit.
JSON and markdown go to --output-dir. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

`--sustained` runs whole epochs instead (`--epochs`, default 3, of `--steps-per-epoch` rows, 40 by
default: sample files far beyond the loader's prefetch window) and reports per epoch the tokens/s
(the trainer's tokens over the sum of its step times; the run's first step, compilation, left
out), the slowest wait for data (`data_wait_seconds`, the trainer's own) and the epoch's first
step time; to `trainer-sustained-<preset>.json`:

    python benchmarks/trainer_gpu.py --preset llama-3.1-8b-draft --runs single --sustained

For long runs on a small disk, `--unique-samples N` writes N files and hard-links the rest to them,
and `--keep-checkpoints K` deletes all but the newest K checkpoints while the run goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.trainer_processes import SAFE_ENV, checkpoint_pruning, run_process_group
from benchmarks.training import LOSS_MASKS, PRESETS, TrainingPreset, synthetic_loss_mask

__all__ = ["RunResult", "main", "summarize_metrics", "write_synthetic_inputs"]

ROOT = Path(__file__).resolve().parent.parent
NUM_CAPTURED_LAYERS = 4
VERIFIER_LAYERS = 32


@dataclass
class RunResult:
    name: str
    processes: int
    command: str
    returncode: int | None
    seconds: float
    steps_logged: int
    timed_steps: int
    tokens_per_step: float | None = None
    median_tokens_per_second: float | None = None
    min_tokens_per_second: float | None = None
    max_tokens_per_second: float | None = None
    spread_percent: float | None = None
    aggregate_tokens_per_second: float | None = None
    median_step_seconds: float | None = None
    peak_memory_gib: float | None = None
    final_loss: float | None = None
    first_step_seconds: float | None = None
    checkpoint_save_seconds: float | None = None
    checkpoint_load_seconds: float | None = None
    checkpoint_save_seconds_each: list[float] | None = None
    checkpoint_loop_wait_seconds_each: list[float] | None = None
    recompiles: int | None = None
    resumed_equal: bool | None = None
    resumed_max_abs_diff: float | None = None
    repeat_equal: bool | None = None
    repeat_max_abs_diff: float | None = None
    median_step_tokens_per_second: float | None = None
    epochs: list[dict[str, Any]] | None = None
    error: str | None = None


SINGLE_NO_ROW_SLOTS = "single-no-row-slots"
ONE_PROCESS_RUNS = ("single", SINGLE_NO_ROW_SLOTS)


# -- inputs --------------------------------------------------------------------------------------
def write_verifier(preset: TrainingPreset, folder: Path, seed: int = 0) -> Path:
    """A Llama-shaped verifier folder holding only embeddings, final norm and LM head (bf16)."""
    import torch
    from safetensors.torch import save_file

    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "num_hidden_layers": VERIFIER_LAYERS,
        "vocab_size": preset.target_vocab_size,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)

    def table() -> torch.Tensor:  # random rows, tiled: drawing 0.5 G normals would take long
        block = (torch.randn(4096, preset.hidden_size, generator=generator) * 0.02).bfloat16()
        repeats = -(-preset.target_vocab_size // block.shape[0])
        return block.repeat(repeats, 1)[: preset.target_vocab_size].contiguous()

    tensors = {
        "model.embed_tokens.weight": table(),
        "model.norm.weight": torch.ones(preset.hidden_size, dtype=torch.bfloat16),
        "lm_head.weight": table(),
    }
    temporary = folder / ".model.safetensors.tmp"
    save_file(tensors, str(temporary), metadata={"format": "pt"})
    temporary.replace(folder / "model.safetensors")
    return folder


def write_vocab_maps(preset: TrainingPreset, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    import numpy as np
    import torch

    d2t_path, t2d_path = folder / "d2t.npy", folder / "t2d.npy"
    if d2t_path.is_file() and t2d_path.is_file():
        return d2t_path, t2d_path
    generator = torch.Generator().manual_seed(seed)
    keep = torch.randperm(preset.target_vocab_size, generator=generator)[: preset.draft_vocab_size]
    keep = keep.sort().values
    t2d = torch.zeros(preset.target_vocab_size, dtype=torch.bool)
    t2d[keep] = True
    np.save(d2t_path, (keep - torch.arange(preset.draft_vocab_size)).numpy())
    np.save(t2d_path, t2d.numpy())
    return d2t_path, t2d_path


def write_samples(
    preset: TrainingPreset,
    folder: Path,
    count: int,
    tokens: int,
    seed: int = 0,
    distinct: int = 4,
    threads: int = 8,
    loss_mask: str = "answer",
    unique: int | None = None,
) -> Path:
    """`count` sample files of `tokens` tokens; hidden states come from `distinct` random draws
    (their values do not change the cost), token ids and masks differ per file. `loss_mask`:
    `answer` (a 10% prompt, then the answer) or one of the step benchmark's kinds."""
    import torch
    from tqdm import tqdm

    from speculators_vllm016.data_generation.sample_io import write_sample

    folder.mkdir(parents=True, exist_ok=True)
    layer_ids = [1, VERIFIER_LAYERS // 2, VERIFIER_LAYERS - 3, VERIFIER_LAYERS - 1]
    (folder / "data_config.json").write_text(
        json.dumps({"hidden_states": {"layer_ids": layer_ids}})
    )
    generator = torch.Generator().manual_seed(seed)
    pool = [
        [
            torch.randn(tokens, preset.hidden_size, generator=generator).bfloat16()
            for _ in range(NUM_CAPTURED_LAYERS)
        ]
        for _ in range(distinct)
    ]

    def write(index: int) -> None:
        path = folder / f"data_{index}.pt"
        if path.is_file():
            return
        if unique and index >= unique:  # a hard link: same bytes, other name, no disk
            os.link(folder / f"data_{index % unique}.pt", path)
            return
        local = torch.Generator().manual_seed(seed * 1_000_003 + index)
        ids = torch.randint(0, preset.target_vocab_size, (tokens,), generator=local)
        if loss_mask == "answer":
            mask = torch.ones(tokens, dtype=torch.long)
            mask[: tokens // 10] = 0  # a prompt, then the answer
        else:
            mask = synthetic_loss_mask(loss_mask, tokens, local)[0]
        write_sample(
            path, {"input_ids": ids, "hidden_states": pool[index % distinct], "loss_mask": mask}
        )

    first = range(min(count, unique) if unique else count)
    with ThreadPoolExecutor(max_workers=threads) as pool_executor:
        list(tqdm(pool_executor.map(write, first), total=len(first), desc="sample files"))
    for index in range(len(first), count):
        write(index)
    return folder


def write_synthetic_inputs(
    preset: TrainingPreset,
    work: Path,
    samples: int,
    tokens: int,
    loss_mask: str = "answer",
    unique: int | None = None,
) -> dict[str, Path]:
    started = time.perf_counter()
    verifier = write_verifier(preset, work / "verifier")
    d2t, t2d = write_vocab_maps(preset, work)
    folder = work / ("data" if loss_mask == "answer" else f"data-{loss_mask}")
    data = write_samples(preset, folder, samples, tokens, loss_mask=loss_mask, unique=unique)
    print(f"inputs ready in {time.perf_counter() - started:.1f} s", flush=True)
    return {"verifier": verifier, "data": data, "d2t": d2t, "t2d": t2d}


# -- runs ----------------------------------------------------------------------------------------
def train_command(
    name: str,
    processes: int,
    paths: dict[str, Path],
    save: Path,
    args: argparse.Namespace,
    max_steps: int | None = None,
    resume: bool = False,
) -> list[str]:
    train = [
        "train",
        "--verifier-name-or-path",
        str(paths["verifier"]),
        "--data-path",
        str(paths["data"]),
        "--save-path",
        str(save),
        "--d2t-path",
        str(paths["d2t"]),
        "--t2d-path",
        str(paths["t2d"]),
        "--total-seq-len",
        str(args.total_seq_len),
        "--max-steps",
        str(max_steps or args.max_steps),
        "--epochs",
        str(getattr(args, "epochs", None) or 1),
        "--train-ratio",
        "1.0",
        "--no-progress",
        "--log-dir",
        str(save.parent / "logs"),
    ]
    if not resume:  # resuming is the trainer's default
        train.append("--no-resume-from-checkpoint")
    if getattr(args, "resume_check", False):
        # The default schedule follows --max-steps (and the data): under the resume check every
        # run, the shorter first part included, gets the same explicit one, so that the parts
        # retrace the uninterrupted run.
        from speculators_vllm016.train.lr_schedule import default_warmup_steps

        train += [
            "--scheduler-total-steps",
            str(args.max_steps),
            "--scheduler-warmup-steps",
            str(default_warmup_steps(args.max_steps)),
        ]
    if args.device:
        train += ["--device", args.device]
    if args.num_workers is not None:
        train += ["--num-workers", str(args.num_workers)]
    if name == SINGLE_NO_ROW_SLOTS:  # the A/B of the loader's row slots, in the same script
        train.append("--no-row-slots")
    train += list(args.train_args)
    if name in ONE_PROCESS_RUNS:
        return [sys.executable, "-m", "speculators_vllm016", *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "speculators_vllm016",
        *train,
        "--parallel",
        name,
    ]


def summarize_metrics(path: Path, warmup_steps: int) -> dict[str, Any]:
    """Throughput of the timed steps in a trainer's metrics.jsonl (train lines only)."""
    from speculators_vllm016.train.metrics_log import read_train_steps

    steps = sorted(read_train_steps(path), key=lambda entry: entry["step"])
    timed = steps[warmup_steps:]
    summary: dict[str, Any] = {"steps_logged": len(steps), "timed_steps": len(timed)}
    if steps:  # compilation included: a fresh process's first step
        summary["first_step_seconds"] = round(steps[0]["step_seconds"], 4)
    if not timed:
        return summary
    tokens = [entry["tokens"] for entry in timed]
    seconds = [entry["step_seconds"] for entry in timed]
    rates = [n / s for n, s in zip(tokens, seconds, strict=True)]
    median = statistics.median(rates)
    memory = [entry.get("peak_memory_gib") for entry in steps]
    memory = [value for value in memory if value is not None]
    summary.update(
        tokens_per_step=round(statistics.mean(tokens), 1),
        median_tokens_per_second=round(median, 1),
        min_tokens_per_second=round(min(rates), 1),
        max_tokens_per_second=round(max(rates), 1),
        spread_percent=round(100 * (max(rates) - min(rates)) / median, 2),
        aggregate_tokens_per_second=round(sum(tokens) / sum(seconds), 1),
        median_step_seconds=round(statistics.median(seconds), 5),
        peak_memory_gib=round(max(memory), 3) if memory else None,
        final_loss=timed[-1].get("loss"),
    )
    return summary


def summarize_epochs(path: Path) -> dict[str, Any]:
    """Per epoch of a trainer's metrics.jsonl: tokens/s over the sum of its step times, the
    slowest wait for data and the first step's time. The run's first step (compilation) is left
    out of the rates and waits, and reported as the first epoch's `first_step_seconds`."""
    from speculators_vllm016.train.metrics_log import read_metrics

    records = sorted((r for r in read_metrics(path) if r.train is not None), key=lambda r: r.step)
    if not records:
        return {"median_step_tokens_per_second": None, "epochs": []}
    first_step = records[0].step
    epochs = []
    for epoch in sorted({r.epoch for r in records if r.epoch is not None}):
        steps = [r for r in records if r.epoch == epoch]
        timed = [r for r in steps if r.step != first_step]
        tokens = sum(r.train["tokens"] for r in timed)
        seconds = sum(r.train["step_seconds"] for r in timed)
        waits = [r.train["data_wait_seconds"] for r in timed if "data_wait_seconds" in r.train]
        epochs.append(
            {
                "epoch": epoch,
                "steps": len(steps),
                "last_step_seconds": round(steps[-1].train["step_seconds"], 4),
                "last_step_tokens": steps[-1].train["tokens"],
                "median_step_seconds": round(
                    statistics.median(r.train["step_seconds"] for r in timed), 4
                )
                if timed
                else None,
                "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
                "max_data_wait_seconds": round(max(waits), 4) if waits else None,
                "steps_waiting_over_0.2_s": sum(wait > 0.2 for wait in waits),
                "total_data_wait_seconds": round(sum(waits), 3),
                "first_step_seconds": round(steps[0].train["step_seconds"], 4),
                "slowest_steps": [
                    {
                        "step": r.step,
                        "seconds": round(r.train["step_seconds"], 4),
                        "data_wait_seconds": round(r.train.get("data_wait_seconds", 0.0), 4),
                    }
                    for r in sorted(timed, key=lambda r: -r.train["step_seconds"])[:5]
                ],
            }
        )
    rates = [
        r.train["tokens"] / r.train["step_seconds"] for r in records[1:] if r.train["step_seconds"]
    ]
    return {
        "median_step_tokens_per_second": round(statistics.median(rates), 1) if rates else None,
        "epochs": epochs,
    }


def checkpoint_seconds(log: str) -> tuple[float | None, float | None]:
    """`(last checkpoint write, weights + optimizer state load)` seconds from a trainer's log."""
    written = re.findall(r"checkpoint \S+ written in ([0-9.]+) s", log)
    loaded = re.findall(r"(?:weights|optimizer state) of \S+ loaded in ([0-9.]+) s", log)
    return (
        float(written[-1]) if written else None,
        round(sum(map(float, loaded)), 3) if len(loaded) == 2 else None,
    )


def last_checkpoint(save: Path) -> Path | None:
    """The checkpoint folder a run wrote last."""
    folders = [folder for folder in save.glob("*") if (folder / "model.safetensors").is_file()]
    return max(folders, key=lambda folder: folder.stat().st_mtime, default=None)


def compare_weights(first: Path, second: Path) -> tuple[bool, float]:
    """`(bit for bit equal, max |difference|)` of two checkpoints' trainable weights (the fp32
    master copy when the checkpoint has one)."""
    import torch
    from safetensors.torch import load_file

    from speculators_vllm016.train.checkpointer import MASTER_WEIGHTS

    name = MASTER_WEIGHTS if (first / MASTER_WEIGHTS).is_file() else "model.safetensors"
    left, right = load_file(first / name), load_file(second / name)
    if left.keys() != right.keys():
        return False, math.inf
    equal = all(torch.equal(left[key], right[key]) for key in left)
    diff = max(
        (float((left[key].double() - right[key].double()).abs().max()) for key in left), default=0.0
    )
    return equal, diff


def _launch(
    command: list[str],
    name: str,
    log: Path,
    timeout: float,
    root: Path = ROOT,
    extra_env: dict[str, str] | None = None,
) -> tuple[int | None, str | None, float]:
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if name in ONE_PROCESS_RUNS and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    print(f"$ {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    # `python -m` puts the working folder first on sys.path: run in ROOT, or another checkout's
    # package (the caller's folder) would be trained instead of ROOT's.
    returncode, error = run_process_group(command, env, log, timeout, cwd=root)
    seconds = time.perf_counter() - started
    if returncode not in (0, None):
        tail = log.read_text(errors="replace").strip().splitlines()[-25:]
        print("\n".join(tail), flush=True)
        error = f"exit {returncode}: " + (tail[-1][:300] if tail else "")
    return returncode, error, seconds


def cold_compile_cache(work: Path, label: str, args: argparse.Namespace) -> dict[str, str]:
    """With `--cold-compile-cache`: an empty compile cache of the run's own (inductor's and
    Triton's), so that every run's first step compiles from nothing, the baseline's too."""
    if not args.cold_compile_cache:
        return {}
    from speculators_vllm016.train.jobs.compiler import compile_cache_environment

    folder = work / f"compile-cache-{label}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return compile_cache_environment(folder)


def run_trainer(
    name: str,
    processes: int,
    paths: dict[str, Path],
    work: Path,
    args: argparse.Namespace,
    root: Path = ROOT,
    label: str | None = None,
) -> RunResult:
    """One trainer run of kind `name` with the package of checkout `root` (`label`: the run's
    name in the results, `baseline` for `--baseline-checkout`)."""
    label = label or name
    save = work / f"run-{label}" / "checkpoints"
    command = train_command(name, processes, paths, save, args)
    log = work / f"run-{label}.log"
    with checkpoint_pruning(save, args.keep_checkpoints):
        returncode, error, seconds = _launch(
            command, name, log, args.run_timeout, root, cold_compile_cache(work, label, args)
        )
    metrics = save / "metrics.jsonl"
    summary = (
        summarize_metrics(metrics, args.warmup_steps)
        if metrics.is_file()
        else {"steps_logged": 0, "timed_steps": 0}
    )
    text = log.read_text(errors="replace") if log.is_file() else ""
    written, _ = checkpoint_seconds(text)
    each = [float(value) for value in re.findall(r"checkpoint \S+ written in ([0-9.]+) s", text)]
    # Background checkpoints log what the step loop waited; a trainer that writes in the loop
    # (before them) waits for the whole write.
    waits = [float(v) for v in re.findall(r"the step loop waited ([0-9.]+) s", text)] or each
    recompiles = text.count("Recompiling function") if "TORCH_LOGS" in os.environ else None
    if args.sustained and metrics.is_file():
        summary.update(summarize_epochs(metrics))
    result = RunResult(
        name=label,
        recompiles=recompiles,
        checkpoint_loop_wait_seconds_each=waits or None,
        processes=processes,
        command=shlex.join(command),
        returncode=returncode,
        seconds=round(seconds, 1),
        error=error,
        checkpoint_save_seconds=written,
        checkpoint_save_seconds_each=each or None,
        **summary,
    )
    if args.resume_check and returncode == 0:
        check_resume(result, paths, work, args, last_checkpoint(save))
    print(json.dumps(asdict(result)), flush=True)
    return result


def check_resume(
    result: RunResult,
    paths: dict[str, Path],
    work: Path,
    args: argparse.Namespace,
    uninterrupted: Path | None,
) -> None:
    """Half the steps, then the same command resumed to the end: load time and final weights.
    The uninterrupted run is repeated too: on a GPU whose kernels are not deterministic, a
    resumed run can only be as close to it as a repeat is."""
    save = work / f"resume-{result.name}" / "checkpoints"
    for part, (steps, resume) in enumerate(
        ((max(1, args.max_steps // 2), False), (args.max_steps, True))
    ):
        command = train_command(result.name, result.processes, paths, save, args, steps, resume)
        log = work / f"resume-{result.name}-{part}.log"
        returncode, error, _ = _launch(command, result.name, log, args.run_timeout)
        if returncode != 0:
            result.error = f"resume check, part {part + 1}: {error}"
            return
    _, result.checkpoint_load_seconds = checkpoint_seconds(log.read_text(errors="replace"))
    repeat = work / f"repeat-{result.name}" / "checkpoints"
    command = train_command(result.name, result.processes, paths, repeat, args)
    returncode, error, _ = _launch(
        command, result.name, work / f"repeat-{result.name}.log", args.run_timeout
    )
    if returncode != 0:
        result.error = f"resume check, repeat: {error}"
        return
    resumed, repeated = last_checkpoint(save), last_checkpoint(repeat)
    if uninterrupted is None or resumed is None or repeated is None:
        result.error = "resume check: a run wrote no checkpoint"
        return
    result.resumed_equal, result.resumed_max_abs_diff = compare_weights(uninterrupted, resumed)
    result.repeat_equal, result.repeat_max_abs_diff = compare_weights(uninterrupted, repeated)


def run_step_benchmark(
    preset: TrainingPreset, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """benchmarks/training.py on the same shapes and row length, in its own process."""
    out = work / "step-benchmark"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "training.py"),
        "--preset",
        preset.name,
        "--packed-tokens",
        str(args.total_seq_len),
        "--steps",
        str(args.step_benchmark_steps),
        "--warmup",
        "3",
        "--output-dir",
        str(out),
        "--tag",
        "trainer-cmp",
    ]
    if args.loss_mask != "answer":
        command += ["--loss-mask", args.loss_mask]
    if args.device:
        command += ["--device", args.device]
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    print(f"$ {shlex.join(command)}", flush=True)
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=args.run_timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"command": shlex.join(command), "error": "timed out"}
    result_file = out / f"training-{preset.name}-trainer-cmp.json"
    if done.returncode != 0 or not result_file.is_file():
        print(done.stdout[-2000:], done.stderr[-3000:], flush=True)
        return {"command": shlex.join(command), "error": f"exit {done.returncode}"}
    row = json.loads(result_file.read_text())["lengths"][0]
    row["command"] = shlex.join(command)
    print(json.dumps(row), flush=True)
    return row


# -- report --------------------------------------------------------------------------------------
def write_markdown(result: dict[str, Any], path: Path) -> None:
    env = result["environment"]
    step = result.get("step_benchmark") or {}
    runs = result["runs"]
    single = next(
        (run for run in runs if run["name"] == "single" and run.get("median_tokens_per_second")),
        None,
    )
    lines = [
        f"# Trainer on sample files: `{result['preset']}`",
        "",
        f"- command: `{result['command']}`",
        f"- device: {env.get('gpu_name') or env.get('cpu_model') or 'cpu'} x{env.get('gpu_count', 0)}; "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}",
        f"- {result['samples']} sample files of {result['sample_tokens']} tokens (bf16, "
        f"{NUM_CAPTURED_LAYERS} layers), rows of {result['total_seq_len']} tokens, "
        f"at most {result['max_steps']} steps per run, the first {result['warmup_steps']} not timed; "
        f"loss masks: {result.get('loss_mask', 'answer')}; files written just before (page cache warm)",
        "- tokens/s: train/tokens (all ranks) over the wall clock between step ends",
        *(
            [
                f"- {result['unique_samples']} distinct files; the others are hard links to them (disk)"
            ]
            if result.get("unique_samples")
            else []
        ),
        "",
        "| run | GPUs | median tokens/s | min | max | spread % | total tokens / total s | "
        "vs 1 GPU | vs step benchmark | peak GiB | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    step_rate = step.get("median_tokens_per_second")
    for run in runs:
        rate = run.get("median_tokens_per_second")
        if not rate:
            lines.append(
                f"| {run['name']} | {run['processes']} | | | | | | | | | {run.get('error') or 'no timed steps'} |"
            )
            continue
        scale = f"{rate / single['median_tokens_per_second']:.2f}x" if single else ""
        versus = f"{rate / step_rate:.2f}x" if step_rate and run["processes"] == 1 else ""
        peak = "" if run.get("peak_memory_gib") is None else f"{run['peak_memory_gib']:.2f}"
        lines.append(
            f"| {run['name']} | {run['processes']} | {rate:,.0f} | {run['min_tokens_per_second']:,.0f} | "
            f"{run['max_tokens_per_second']:,.0f} | {run['spread_percent']:.1f} | "
            f"{run['aggregate_tokens_per_second']:,.0f} | {scale} | {versus} | {peak} | "
            f"{run.get('error') or ''} |"
        )
    if step_rate:
        lines.append(
            f"| step benchmark | 1 | {step_rate:,.0f} | {step['min_tokens_per_second']:,.0f} | "
            f"{step['max_tokens_per_second']:,.0f} | {step['spread_percent']:.1f} | | | 1.00x | "
            f"{step.get('peak_memory_gib') or ''} | synthetic rows on the GPU |"
        )
    elif step:
        lines.append(f"| step benchmark | 1 | | | | | | | | | {step.get('error')} |")
    checkpointed = [run for run in runs if run.get("checkpoint_save_seconds") is not None]
    if checkpointed:
        lines += [
            "",
            "| run | GPUs | last checkpoint write s | resume: load s (weights + optimizer) | "
            "resumed vs uninterrupted: final weights | repeat vs uninterrupted: final weights |",
            "|---|---:|---:|---:|---|---|",
        ]

        def same(run: dict[str, Any], kind: str) -> str:
            equal, diff = run.get(f"{kind}_equal"), run.get(f"{kind}_max_abs_diff")
            if equal is None:
                return ""
            return "equal, bit for bit" if equal else f"differ, max abs diff {diff:.3g}"

        for run in checkpointed:
            load = run.get("checkpoint_load_seconds")
            lines.append(
                f"| {run['name']} | {run['processes']} | {run['checkpoint_save_seconds']:.2f} | "
                f"{'' if load is None else f'{load:.2f}'} | {same(run, 'resumed')} | {same(run, 'repeat')} |"
            )
    for run in runs:
        if not run.get("epochs"):
            continue
        median = run.get("median_step_tokens_per_second") or 0
        lines += [
            "",
            f"Per epoch, `{run['name']}` (median step {median:,.0f} tokens/s; the run's first "
            "step, compilation, is not in the rates):",
            "",
            "| epoch | steps | tokens/s | vs median step | slowest data wait s | steps waiting > 0.2 s "
            "| first step s | median step s | last step s (tokens) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for epoch in run["epochs"]:
            rate = epoch.get("tokens_per_second") or 0
            ratio = f"{rate / median:.2f}x" if median else ""
            lines.append(
                f"| {epoch['epoch']} | {epoch['steps']} | {rate:,.0f} | {ratio} | "
                f"{'' if epoch.get('max_data_wait_seconds') is None else epoch['max_data_wait_seconds']} | "
                f"{epoch.get('steps_waiting_over_0.2_s', '')} | "
                f"{epoch['first_step_seconds']} | {epoch.get('median_step_seconds', '')} | "
                f"{epoch.get('last_step_seconds', '')} ({epoch.get('last_step_tokens', '')}) |"
            )
        if run.get("checkpoint_save_seconds_each"):
            lines += [
                "",
                f"Checkpoint writes, s: {', '.join(map(str, run['checkpoint_save_seconds_each']))}",
            ]
        if run.get("checkpoint_loop_wait_seconds_each"):
            waits = ", ".join(map(str, run["checkpoint_loop_wait_seconds_each"]))
            lines += ["", f"The step loop waited for each checkpoint, s: {waits}"]
        if run.get("recompiles") is not None:
            lines += ["", f"Recompilations logged (TORCH_LOGS=recompiles): {run['recompiles']}"]
    from benchmarks.trainer_030 import markdown_lines as lines_030

    lines += lines_030(runs)
    lines += ["", "Commands:", ""]
    lines += [f"- `{run['command']}`" for run in runs]
    if step.get("command"):
        lines.append(f"- `{step['command']}`")
    path.write_text("\n".join(lines) + "\n")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/trainer_gpu.py",
        description=__doc__.split("\n\n")[2],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", default="llama-3.1-8b-draft", choices=sorted(PRESETS))
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=(*ONE_PROCESS_RUNS, "ddp", "fsdp"),
        default=["single", "ddp", "fsdp"],
        help=f"{SINGLE_NO_ROW_SLOTS}: one GPU with --no-row-slots (the loader's hand-off "
        "before the row slots), for an A/B beside `single`",
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="processes of ddp/fsdp (default: all GPUs)"
    )
    parser.add_argument("--work-dir", default="/tmp/trainer-gpu", help="inputs and checkpoints")
    parser.add_argument("--sample-tokens", type=int, default=None, help="default: the preset's")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="sample files (default: enough for --max-steps on --gpus ranks)",
    )
    parser.add_argument("--total-seq-len", type=int, default=8192)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=None, help="loader processes per rank")
    parser.add_argument("--device", default=None, help="passed to the trainer (default: its own)")
    parser.add_argument(
        "--step-benchmark",
        action="store_true",
        help="also run benchmarks/training.py on the same shapes",
    )
    parser.add_argument("--step-benchmark-steps", type=int, default=20)
    parser.add_argument(
        "--loss-mask",
        choices=("answer", *LOSS_MASKS),
        default="answer",
        help="the samples' loss masks: answer (a 10%% prompt, then the answer) or "
        "the step benchmark's kinds (then its run uses the same)",
    )
    parser.add_argument("--run-timeout", type=int, default=300, help="seconds per run")
    parser.add_argument(
        "--resume-check",
        action="store_true",
        help="per run kind: half the steps, resume to the end, and a repeat of the "
        "whole run; compare their final weights with the run's",
    )
    parser.add_argument(
        "--train-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="further `speculators train` flags (last on the line)",
    )
    parser.add_argument(
        "--sustained",
        action="store_true",
        help="whole epochs on files beyond the prefetch window; per-epoch figures",
    )
    parser.add_argument("--epochs", type=int, default=None, help="with --sustained (default 3)")
    parser.add_argument(
        "--steps-per-epoch",
        type=int,
        default=40,
        help="with --sustained: rows per epoch per rank (sets the sample count)",
    )
    parser.add_argument(
        "--unique-samples",
        type=int,
        default=None,
        help="write this many sample files and hard-link the rest to them (disk)",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=None,
        help="delete all but the newest N checkpoints while a run goes (disk)",
    )
    parser.add_argument(
        "--with-030",
        default=None,
        metavar="PATH",
        help="with --sustained: then run speculators 0.3.0's scripts/train.py (PATH: "
        "it, or the folder holding it as speculators030_train.py) on the same files",
    )
    parser.add_argument(
        "--with-030-timeout",
        type=int,
        default=None,
        help="seconds for the 0.3.0 run (default: --run-timeout)",
    )
    parser.add_argument(
        "--cold-compile-cache",
        action="store_true",
        help="every run with an empty compile cache of its own (TORCHINDUCTOR_CACHE_DIR, "
        "TRITON_CACHE_DIR): first steps compiled from nothing, comparable across runs",
    )
    parser.add_argument(
        "--baseline-checkout",
        default=None,
        metavar="PATH",
        help="first run `single` with the package of this checkout (the code before a change) "
        "as run `baseline`: before and after on the same inputs in one result file",
    )
    parser.add_argument("--output-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    import torch

    from benchmarks.training import environment

    preset = PRESETS[args.preset]
    gpus = args.gpus or max(torch.cuda.device_count(), 1)
    tokens = args.sample_tokens or preset.sample_tokens
    per_row = max(1, args.total_seq_len // (tokens - 1))
    ranks = gpus if set(args.runs) - set(ONE_PROCESS_RUNS) else 1
    if args.sustained:
        args.epochs = args.epochs or 3
        samples = args.samples or args.steps_per_epoch * per_row * ranks
        args.max_steps = args.epochs * samples  # never the limit: whole epochs run
        args.warmup_steps = 1
        args.run_timeout = max(args.run_timeout, 420)
    else:
        samples = args.samples or (args.max_steps + 2) * per_row * ranks
    work = Path(args.work_dir)
    paths = write_synthetic_inputs(
        preset, work, samples, tokens, args.loss_mask, args.unique_samples
    )
    command = "python benchmarks/trainer_gpu.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"trainer{'-sustained' if args.sustained else ''}-{preset.name}" + (
        f"-{args.tag}" if args.tag else ""
    )
    result: dict[str, Any] = {
        "preset": preset.name,
        "command": command,
        "samples": samples,
        "sample_tokens": tokens,
        "total_seq_len": args.total_seq_len,
        "max_steps": args.max_steps,
        "warmup_steps": args.warmup_steps,
        "loss_mask": args.loss_mask,
        "runs": [],
        "step_benchmark": None,
        "epochs": args.epochs,
        "unique_samples": args.unique_samples,
    }

    def save() -> None:  # after every run: a run killed later loses nothing measured before
        described = environment()
        described["gpu_count"] = torch.cuda.device_count()
        result["environment"] = described
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        write_markdown(result, out / f"{stem}.md")

    if args.step_benchmark:
        result["step_benchmark"] = run_step_benchmark(preset, work, args)
        save()
    if args.baseline_checkout:  # the code before a change, same inputs, same script
        baseline = run_trainer(
            "single", 1, paths, work, args, Path(args.baseline_checkout).resolve(), "baseline"
        )
        result["runs"].append(asdict(baseline))
        save()
        if args.keep_checkpoints:  # a small disk: the baseline's last checkpoint goes too
            shutil.rmtree(work / "run-baseline" / "checkpoints", ignore_errors=True)
    for name in args.runs:
        result["runs"].append(
            asdict(run_trainer(name, 1 if name in ONE_PROCESS_RUNS else gpus, paths, work, args))
        )
        save()
    if args.with_030 and args.sustained:  # 0.3.0's own trainer on the same files (issue #28)
        from benchmarks.trainer_030 import run_030

        result["runs"].append(
            run_030(
                args.with_030,
                paths,
                work,
                total_seq_len=args.total_seq_len,
                epochs=args.epochs,
                sample_tokens=tokens,
                samples=samples,
                timeout=args.with_030_timeout or args.run_timeout,
                keep_checkpoints=args.keep_checkpoints,
            )
        )
        save()
    print((out / f"{stem}.md").read_text(), flush=True)
    return result


def failed_runs(result: dict) -> list[str]:
    """The runs of a result that did not finish: a trainer that exited non-zero (e.g. refused its
    arguments with exit 2) measured nothing, and the benchmark must not end as if it had."""
    return [
        f"{run['name']}: {run.get('error') or 'exit ' + str(run.get('returncode'))}"
        for run in result["runs"]
        if run.get("returncode") not in (0, None) or run.get("error")
    ]


if __name__ == "__main__":
    failed = failed_runs(main())
    if failed:
        print("runs that failed: " + "; ".join(failed), file=sys.stderr, flush=True)
        sys.exit(1)
