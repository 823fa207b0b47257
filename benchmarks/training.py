"""EAGLE-3 draft training step throughput and peak memory, on synthetic batches.

    python benchmarks/training.py --preset llama-3.1-8b-draft --packed-tokens 2048 8192 32768

One step is the trainer's own (`train.train_step.TrainStep`, what `Trainer.train_step` runs per
packed row): forward over `--ttt-steps` test-time steps, backward, gradient clipping at 1.0 and
AdamW (fused on CUDA, the clip folded into it), the step's metrics brought to the host, with the
verifier's embeddings, final norm and LM head frozen. The synthetic rows score 70% of their
positions (`loss_mask`: each position on its own by default, `--loss-mask spans` as chat turns
do, `all` every position). The first `--warmup` steps (compilation included) are not timed;
the median and spread of the next `--steps` give tokens/s (packed tokens per second). Peak
memory is the largest allocation seen during the timed steps. Needs only torch, transformers,
safetensors and pydantic (no vLLM); JSON and markdown go to --output-dir.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = [
    "PRESETS",
    "TrainingPreset",
    "kernel_category",
    "main",
    "own_microseconds",
    "profile_summary",
    "run_length",
]


@dataclass(frozen=True)
class TrainingPreset:
    """Shapes of one draft and its verifier (what the step's cost depends on)."""

    name: str
    description: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    num_layers: int = 1
    sample_tokens: int = 2048
    default_packed_tokens: tuple[int, ...] = (2048, 8192)
    requires_gpu: bool = True


PRESETS: dict[str, TrainingPreset] = {
    preset.name: preset
    for preset in (
        TrainingPreset(
            "llama-3.1-8b-draft",
            "EAGLE-3 draft of Llama-3.1-8B (hidden 4096, 32/8 heads, vocab 128256 -> 32000)",
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            target_vocab_size=128256,
            draft_vocab_size=32000,
            default_packed_tokens=(2048, 8192, 32768),
        ),
        TrainingPreset(
            "kimi-k2.5-draft",
            "EAGLE-3 draft of Kimi-K2.5 (hidden 7168, 64/64 heads, vocab 163840 -> 32000)",
            hidden_size=7168,
            num_attention_heads=64,
            num_key_value_heads=64,
            head_dim=112,
            intermediate_size=18432,
            target_vocab_size=163840,
            draft_vocab_size=32000,
            default_packed_tokens=(2048, 8192),
        ),
        TrainingPreset(
            "cpu-small",
            "a small draft that runs on a CPU in seconds (hidden 256, vocab 2048 -> 512)",
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            target_vocab_size=2048,
            draft_vocab_size=512,
            sample_tokens=128,
            default_packed_tokens=(256,),
            requires_gpu=False,
        ),
    )
}


@dataclass
class LengthResult:
    packed_tokens: int
    step_seconds: list[float]
    median_tokens_per_second: float
    min_tokens_per_second: float
    max_tokens_per_second: float
    spread_percent: float
    peak_memory_gib: float | None
    peak_reserved_gib: float | None
    final_loss: float
    error: str | None = None
    profile_ms: dict[str, float] | None = None


def draw_vocab_subset(model: Any, preset: TrainingPreset, device) -> None:
    """Point `model`'s vocabulary maps at a fixed random (seed 0) draft-vocabulary subset of the
    target's: the same subset for every draft a benchmark builds, Llama or MLA layer."""
    import torch

    generator = torch.Generator().manual_seed(0)
    keep = torch.randperm(preset.target_vocab_size, generator=generator)[: preset.draft_vocab_size]
    keep = keep.sort().values
    with torch.no_grad():
        model.t2d.zero_()
        model.t2d[keep.to(device)] = True
        model.d2t.copy_((keep - torch.arange(preset.draft_vocab_size)).to(device))


def build_model(preset: TrainingPreset, device, frozen_dtype, attention: str, compile_blocks):
    import torch
    from transformers import LlamaConfig

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    layer = LlamaConfig(
        hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        vocab_size=preset.target_vocab_size,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=preset.draft_vocab_size,
        norm_before_residual=True,
    )
    with torch.device(device):
        model = Eagle3DraftModel(config)
    draw_vocab_subset(model, preset, device)
    model.attention_backend = attention
    model.compile_blocks = compile_blocks
    if frozen_dtype is not None:
        model.frozen_weights_to(frozen_dtype)
    return model


LOSS_MASKS = ("random", "spans", "all")
TURN_TOKENS = 256  # `spans`: turns of a prompt (the first 30%, masked) and a scored response


def synthetic_loss_mask(kind: str, packed_tokens: int, generator) -> Any:
    """`[1, packed_tokens]` of 0/1, 70% ones unless `all`: `random` draws each position on its
    own, `spans` masks the first 30% of every `TURN_TOKENS`-token turn (prompt, then response)."""
    import torch

    if kind == "random":
        return (torch.rand(1, packed_tokens, generator=generator) < 0.7).long()
    if kind == "spans":
        return ((torch.arange(packed_tokens) % TURN_TOKENS) >= round(0.3 * TURN_TOKENS)).long()[
            None
        ]
    if kind == "all":
        return torch.ones(1, packed_tokens, dtype=torch.long)
    raise ValueError(f"loss mask kind must be one of {LOSS_MASKS}, got {kind!r}")


def synthetic_batch(
    preset: TrainingPreset,
    packed_tokens: int,
    device,
    dtype,
    seed: int = 0,
    loss_mask: str = "random",
):
    """A packed row of whole samples, shaped as the trainer's shifted batches are."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    sample = min(preset.sample_tokens, packed_tokens)
    lengths = [sample] * (packed_tokens // sample)
    if packed_tokens % sample:
        lengths.append(packed_tokens % sample)
    mask = synthetic_loss_mask(loss_mask, packed_tokens, generator)
    return {
        "hidden_states": torch.randn(
            1, packed_tokens, 3 * preset.hidden_size, generator=generator
        ).to(device, dtype),
        "input_ids": torch.randint(
            0, preset.target_vocab_size, (1, packed_tokens), generator=generator
        ).to(device),
        "verifier_last_hidden_states": torch.randn(
            1, packed_tokens, preset.hidden_size, generator=generator
        ).to(device, dtype),
        "loss_mask": mask.to(device),
        "lengths": torch.tensor(lengths, device=device),
        "position_ids": torch.cat([torch.arange(1, n + 1) for n in lengths])[None].to(device),
    }


def run_length(
    args: argparse.Namespace, preset: TrainingPreset, packed_tokens: int
) -> LengthResult:
    """Build a fresh model and optimizer, warm up, then time `args.steps` training steps."""
    import torch

    from speculators_vllm016.models.eagle3.model_definitions import use_reproducible_compilation
    from speculators_vllm016.train.draft_contract import DraftCallOptions
    from speculators_vllm016.train.loading.device_rows import StepRow
    from speculators_vllm016.train.train_step import TrainStep, build_optimizer

    use_reproducible_compilation(args.deterministic)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    precision = args.precision
    param_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    autocast = precision == "bf16-mixed"
    frozen = {"bf16": torch.bfloat16, "fp32": torch.float32, "same": None}[args.frozen_dtype]
    compile_blocks = {"auto": None, "on": True, "off": False}[args.compile]
    if cuda:
        torch._dynamo.reset()  # one training run has one packed length: compile it afresh
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build_model(preset, device, frozen, args.attention, compile_blocks)
    if param_dtype != torch.float32:
        model.to(param_dtype)
    model.loss_chunk_size = args.loss_chunk_size
    model.skip_unused_positions = {"auto": None, "on": True, "off": False}[
        args.skip_unused_positions
    ]
    for layer in model.layers:
        layer.recompute_mlp = args.recompute_mlp
    model.train()
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.01, device=device)
    data_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    batch = synthetic_batch(preset, packed_tokens, device, data_dtype, loss_mask=args.loss_mask)
    row = StepRow(batch, has_samples=True)
    # The trainer's own step: forward, backward, clip at 1.0, AdamW, metrics to the host.
    train_step = TrainStep(
        model=model,
        optimizer=optimizer,
        parameters=[p for p in model.parameters() if p.requires_grad],
        device=device,
        max_grad_norm=1.0,
        call_options=DraftCallOptions(ttt_steps=args.ttt_steps),
        autocast_dtype=torch.bfloat16 if autocast else None,
    )

    def step() -> float:
        return train_step(row)["loss"]  # noqa: F821 - deleted with its closure below

    loss = None
    for _ in range(args.warmup):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    profile = profile_summary(step, cuda) if args.profile else None
    rates = [packed_tokens / t for t in times]
    median = statistics.median(rates)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
    final = float(loss) if loss is not None else float("nan")
    del model, optimizer, batch, row, train_step, step
    return LengthResult(
        packed_tokens=packed_tokens,
        step_seconds=[round(t, 5) for t in times],
        median_tokens_per_second=round(median, 1),
        min_tokens_per_second=round(min(rates), 1),
        max_tokens_per_second=round(max(rates), 1),
        spread_percent=round(100 * (max(rates) - min(rates)) / median, 2),
        peak_memory_gib=None if peak is None else round(peak, 3),
        peak_reserved_gib=None if reserved is None else round(reserved, 3),
        final_loss=final,
        profile_ms=profile,
    )


MATMUL_MARKERS = ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION_MARKERS = ("flex_attention", "flash", "attention", "fmha")
OPTIMIZER_MARKERS = ("adam", "fusedoptimizer")


def kernel_category(name: str) -> str:
    """`matmul`, `attention`, `optimizer` or `other`: where a kernel's (or CPU op's) time goes."""
    lowered = name.lower()
    for category, markers in (
        ("matmul", MATMUL_MARKERS),
        ("attention", ATTENTION_MARKERS),
        ("optimizer", OPTIMIZER_MARKERS),
    ):
        if any(marker in lowered for marker in markers):
            return category
    return "other"


def own_microseconds(entry: Any, cuda: bool, cuda_type: Any) -> float:
    """An averaged profiler entry's own time, counted once: on CUDA only kernels (CPU ops, and
    annotations such as `Optimizer.step#AdamW.step`, also report the device time of the kernels
    inside them), on a CPU the op's own CPU time."""
    if not cuda:
        return entry.self_cpu_time_total
    if entry.device_type != cuda_type or getattr(entry, "is_user_annotation", False):
        return 0.0
    return entry.self_device_time_total


def profile_summary(step, cuda: bool) -> dict[str, float]:
    """One more step under the profiler: milliseconds by `kernel_category` (GPU kernels on CUDA,
    CPU ops' own time on a CPU), their total and the step's wall time. Prints the top kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(averages.table(sort_by=sort_key, row_limit=40, max_name_column_width=110), flush=True)
    totals: dict[str, float] = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for entry in averages:
        totals[kernel_category(entry.key)] += own_microseconds(entry, cuda, DeviceType.CUDA) / 1e3
    summary = {key: round(value, 2) for key, value in totals.items()}
    summary["total"] = round(sum(totals.values()), 2)
    summary["wall"] = round(wall * 1e3, 2)
    print(f"profile (ms): {summary}", flush=True)
    return summary


def _gpu_processes() -> list[str]:
    """Other work on the GPUs while this ran (nvidia-smi's compute processes)."""
    try:
        output = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid,process_name,used_memory",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in output.splitlines() if line.strip()]


def environment() -> dict[str, Any]:
    import os

    import torch

    try:
        from benchmarks.environment import describe_environment

        described = describe_environment()
    except Exception as err:  # noqa: BLE001 - the record is best effort (psutil may be absent)
        described = {"error": str(err)}
    described["torch"] = torch.__version__
    try:
        import transformers

        described["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        described["gpu_name"] = torch.cuda.get_device_name(0)
        described["gpu_processes_at_end"] = _gpu_processes()
    described["load_average"] = os.getloadavg()
    return described


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/training.py",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Presets: " + "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values()),
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument(
        "--packed-tokens",
        type=int,
        nargs="+",
        default=None,
        help="packed row lengths to measure, each with a fresh model (default: the preset's)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per length (default 10)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first, compilation included (default 3)",
    )
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16-mixed", "bf16", "fp32"),
        default="auto",
        help="bf16-mixed: fp32 parameters and optimizer state, bf16 autocast "
        "(the trainer's default on GPUs); bf16: bf16 parameters (0.3.0's FSDP "
        "path); fp32; auto: bf16-mixed on CUDA, fp32 on a CPU",
    )
    parser.add_argument(
        "--frozen-dtype",
        choices=("bf16", "fp32", "same"),
        default="bf16",
        help="storage of the frozen verifier embeddings/norm/head (default bf16)",
    )
    parser.add_argument("--attention", choices=("auto", "flex", "sdpa"), default="auto")
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="compile the element-wise blocks (auto: on CUDA)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="compile as `speculators train --deterministic` does (blocks with "
        "symbolic shapes from the first step, no rounding-changing autotuning)",
    )
    parser.add_argument(
        "--recompute-mlp",
        action="store_true",
        help="recompute the MLP in the backward pass (less memory, more work)",
    )
    parser.add_argument("--loss-chunk-size", type=int, default=4096)
    parser.add_argument(
        "--loss-mask",
        choices=LOSS_MASKS,
        default="random",
        help="which positions are scored: 70%% drawn each on its own (random, the "
        "default), the answers of 256-token turns with a 30%% prompt (spans), or "
        "all of them (all)",
    )
    parser.add_argument(
        "--skip-unused-positions",
        choices=("auto", "on", "off"),
        default="auto",
        help="run each TTT step's layer only over the positions the loss reads "
        "(auto: on CUDA, as the trainer does)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one more step: the top kernels, and the "
        "milliseconds of matrix products, attention, optimizer and the rest "
        "(stored as profile_ms)",
    )
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--output-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--note", default="", help="free text stored with the result")
    return parser


def write_markdown(result: dict[str, Any], path: Path) -> None:
    env = result["environment"]
    settings = result["settings"]
    device = env.get("gpu_name") or env.get("cpu_model") or "cpu"
    lines = [
        f"# Training step benchmark: `{result['preset']['name']}`",
        "",
        result["preset"]["description"],
        "",
        f"- command: `{result['command']}`",
        f"- device: {device}; torch {env.get('torch')}, transformers {env.get('transformers')}",
        f"- precision {settings['precision']}, frozen weights {settings['frozen_dtype']}, attention "
        f"{settings['attention']}, compile {settings['compile']}, recompute MLP "
        f"{settings['recompute_mlp']}, deterministic {settings.get('deterministic', False)}, "
        f"TTT steps {settings['ttt_steps']}, loss mask "
        f"{settings.get('loss_mask', 'random')}, skip unused positions "
        f"{settings.get('skip_unused_positions', 'off')}, "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps",
        f"- other GPU processes at the end: {env.get('gpu_processes_at_end') or 'none listed'}",
        "",
        "| packed tokens | median tokens/s | min | max | spread % | peak GiB | note |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["lengths"]:
        if row.get("error"):
            lines.append(f"| {row['packed_tokens']} | | | | | | {row['error']} |")
            continue
        peak = "" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.2f}"
        lines.append(
            f"| {row['packed_tokens']} | {row['median_tokens_per_second']:,.0f} | "
            f"{row['min_tokens_per_second']:,.0f} | {row['max_tokens_per_second']:,.0f} | "
            f"{row['spread_percent']:.1f} | {peak} | |"
        )
    if result.get("note"):
        lines += ["", result["note"]]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    import torch

    preset = PRESETS[args.preset]
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.precision == "auto":
        args.precision = "bf16-mixed" if args.device.startswith("cuda") else "fp32"
    if preset.requires_gpu and not args.device.startswith("cuda"):
        raise SystemExit(f"preset {preset.name} needs a CUDA GPU; use --preset cpu-small here")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be at least 1 and --warmup at least 0")
    lengths = args.packed_tokens or list(preset.default_packed_tokens)
    rows: list[LengthResult] = []
    for packed in lengths:
        try:
            row = run_length(args, preset, packed)
        except Exception as err:  # noqa: BLE001 - one failing length must not lose the others
            import traceback

            traceback.print_exc()
            kind = (
                "out of memory" if isinstance(err, torch.OutOfMemoryError) else type(err).__name__
            )
            row = LengthResult(
                packed,
                [],
                0.0,
                0.0,
                0.0,
                0.0,
                None,
                None,
                float("nan"),
                error=f"{kind}: {str(err).splitlines()[0][:160] if str(err) else ''}",
            )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
    command = "python benchmarks/training.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "preset": asdict(preset),
        "settings": {key: value for key, value in vars(args).items() if key not in ("output_dir",)},
        "command": command,
        "lengths": [asdict(row) for row in rows],
        "environment": environment(),
        "note": args.note,
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"training-{preset.name}" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_markdown(result, out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())
    return result


if __name__ == "__main__":
    main()
