"""Where one training step's device time goes, per op class, and the MLA draft beside the Llama one.

    python benchmarks/step_profile.py --preset kimi-k2.5-draft --packed-tokens 8192 \
        --archs llama mla --output results.json

The trainer's own step (`TrainStep`: forward, backward, clip, AdamW) on one synthetic packed row
of whole samples (`answer` loss masks: a 10% prompt, then the answer, as `trainer_gpu.py`'s
files), with the settings the trainer gives the draft (frozen copies in bf16, rows padded to the
row length, positions nothing reads skipped). Per draft layer architecture (`--archs`: `llama`,
the Llama decoder layer; `mla`, DeepSeek's multi-head latent attention layer shaped from a
Kimi-K2.5 (DeepSeek-V3) target, as `--draft-arch mla` builds it): the first step's wall time
(compilation), the median and spread of `--steps` timed steps, and one more step under
torch.profiler whose device time is split by op class:

- `draft layer`: the decoder layer of every TTT step and the draft's final norm;
- `fusion fc`: the fused auxiliary states' `fc` (step 0's input);
- `fused loss`: the draft head over the draft vocabulary, the loss and metrics of every step;
- `verifier head`: the targets (verifier norm and head rows of the draft vocabulary) and the
  positions each step scores;
- `optimizer`: the gradient clip and AdamW;
- `other`: the rest (embeddings of the fed tokens, the next step's ids, the metrics' reduction);
- `copies` (kernel names `Memcpy`/`Memset`, counted inside the classes above as well): data
  movement on the device.

Backward kernels are charged to the class of the forward op that recorded their autograd node
(the profiler's sequence numbers), so every class holds its forward and its backward. Data
movement between host and device in a real run (the loader's copies) is not in this step: the
trainer reports it as `data_wait_seconds` (see `trainer_gpu.py`).

`--idle` (CUDA): the time the GPU waits for the host within two more steps, charged to the code
that launched the work ending each wait (`attribute_idle`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.training import PRESETS, TrainingPreset

__all__ = ["REGIONS", "attribute_device_time", "main"]

REGIONS = ("draft layer", "fusion fc", "fused loss", "verifier head", "optimizer")
_PREFIX = "region: "
_COPY_MARKERS = ("memcpy", "memset")


def kimi_text_config(preset: TrainingPreset) -> Any:
    """A DeepSeek-V3 text config of the preset's shape (Kimi-K2.5's: DeepSeek-V3's defaults are
    its latent attention ranks and head dims), the target an MLA draft is shaped from."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=preset.target_vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_attention_heads,
    )


def build_draft(preset: TrainingPreset, arch: str, device: Any, packed_tokens: int) -> Any:
    """The draft as the trainer sets it up: `build_model`'s Llama draft, or the MLA one."""
    import torch

    from benchmarks.training import build_model, draw_vocab_subset

    frozen = torch.bfloat16 if torch.device(device).type == "cuda" else None  # as the trainer
    if arch == "llama":
        model = build_model(preset, device, frozen, "auto", None)
    else:
        from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators_vllm016.models.eagle3.mla_layout import mla_layer_config

        layer = mla_layer_config(kimi_text_config(preset), verifier_model_type="kimi_k25")
        config = Eagle3SpeculatorConfig(
            transformer_layer_config=layer,
            draft_vocab_size=preset.draft_vocab_size,
            norm_before_residual=True,
            target_hidden_size=preset.hidden_size,
        )
        with torch.device(device):
            model = Eagle3DraftModel(config)
        draw_vocab_subset(model, preset, device)
        if frozen is not None:
            model.frozen_weights_to(frozen)
    model.skip_unused_positions = None  # the trainer's choice (draft_build)
    model.flex_row_length = packed_tokens
    return model.train()


def answer_batch(preset: TrainingPreset, packed_tokens: int, device: Any, seed: int = 0) -> Any:
    """`synthetic_batch` with `trainer_gpu.py`'s masks: each sample's first 10% unscored."""
    import torch

    from benchmarks.training import synthetic_batch

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    batch = synthetic_batch(preset, packed_tokens, device, dtype, seed, loss_mask="all")
    mask = batch["loss_mask"].clone()
    start = 0
    for length in batch["lengths"].tolist():
        mask[0, start : start + length // 10] = 0
        start += length
    batch["loss_mask"] = mask
    return batch


def _region(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(_PREFIX + name):
            return function(*args, **kwargs)

    return wrapped


def mark_regions(model: Any) -> Callable[[], None]:
    """Wrap the draft's parts (and the trainer's optimizer step) in named profiler ranges;
    returns the function that removes the wraps."""
    import speculators_vllm016.train.train_step as train_step

    parts = {
        "run_layers": "draft layer",
        "final_norm": "draft layer",
        "fuse_aux_states": "fusion fc",
        "_score_step": "fused loss",
        "_start_scoring": "verifier head",
    }
    for method, name in parts.items():
        setattr(model, method, _region(name, getattr(model, method)))
    original = train_step.clip_and_step
    train_step.clip_and_step = _region("optimizer", original)

    def restore() -> None:
        for method in parts:
            delattr(model, method)
        train_step.clip_and_step = original

    return restore


def _region_of(event: Any) -> str | None:
    while event is not None:
        if event.name.startswith(_PREFIX):
            return event.name[len(_PREFIX) :]
        event = event.cpu_parent
    return None


def _own_time(event: Any, cuda: bool) -> float:
    """Microseconds of the kernels this CPU op launched itself (CUDA), or its own CPU time."""
    if cuda:
        return sum(kernel.duration for kernel in event.kernels)
    return event.self_cpu_time_total


def attribute_device_time(
    events: Any, cuda: bool, ops: dict[str, dict[str, float]] | None = None
) -> dict[str, float]:
    """Milliseconds per op class of one profiled step's events (`prof.events()`): each CPU op's
    own kernels (own CPU time on a CPU) go to the region it ran in; an op of the backward pass
    runs in none, and goes to the region of the forward op whose autograd node it evaluates
    (same sequence number), found through its enclosing `evaluate_function` range. `ops`, when
    given, gets per class the microseconds of each op name (`bwd ` before a backward one)."""
    forward_region: dict[int, str] = {}
    for event in events:
        seq = getattr(event, "sequence_nr", -1)
        if seq >= 0 and not event.name.startswith("autograd::engine"):
            region = _region_of(event)
            if region is not None:
                forward_region.setdefault(seq, region)
    totals = {name: 0.0 for name in (*REGIONS, "other")}
    copies = 0.0
    for event in events:
        if getattr(event, "device_type", None) is not None and event.device_type.name != "CPU":
            continue
        own = _own_time(event, cuda)
        if not own:
            continue
        region, name = _region_of(event), event.name
        if region is None:
            node = event
            while node is not None and not node.name.startswith("autograd::engine"):
                node = node.cpu_parent
            if node is not None:
                region, name = forward_region.get(node.sequence_nr), f"bwd {event.name}"
        totals[region or "other"] += own
        if ops is not None:
            by_name = ops.setdefault(region or "other", {})
            by_name[name] = by_name.get(name, 0.0) + own
        if cuda:
            copies += sum(
                k.duration for k in event.kernels if any(m in k.name.lower() for m in _COPY_MARKERS)
            )
    result = {name: round(value / 1e3, 3) for name, value in totals.items()}
    result["total"] = round(sum(totals.values()) / 1e3, 3)
    result["copies"] = round(copies / 1e3, 3)
    return result


def profile_step(step: Callable[[], Any], model: Any, cuda: bool) -> dict[str, Any]:
    """One step under the profiler: milliseconds per op class, the step's wall time, and per
    class its costliest ops (`top_ops_ms`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    restore = mark_regions(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        restore()
    events = prof.events()
    ops: dict[str, dict[str, float]] = {}
    summary: dict[str, Any] = attribute_device_time(events, cuda, ops)
    summary["wall"] = round(wall * 1e3, 3)
    summary["top_ops_ms"] = {
        region: [
            [name, round(us / 1e3, 3)]
            for name, us in sorted(by_name.items(), key=lambda x: -x[1])[:8]
        ]
        for region, by_name in ops.items()
    }
    sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_key, row_limit=25, max_name_column_width=90))
    return summary


def run_arch(args: argparse.Namespace, preset: TrainingPreset, arch: str) -> dict[str, Any]:
    import torch

    from speculators_vllm016.train.draft_contract import DraftCallOptions
    from speculators_vllm016.train.loading.device_rows import StepRow
    from speculators_vllm016.train.train_step import TrainStep, build_optimizer

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_draft(preset, arch, device, args.packed_tokens)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.01, device=device)
    row = StepRow(answer_batch(preset, args.packed_tokens, device), has_samples=True)
    train_step = TrainStep(
        model=model,
        optimizer=optimizer,
        parameters=[p for p in model.parameters() if p.requires_grad],
        device=device,
        call_options=DraftCallOptions(ttt_steps=args.ttt_steps),
        autocast_dtype=torch.bfloat16 if cuda else None,
    )
    tokens = float(row.inputs["lengths"].sum())

    def step() -> dict[str, float]:
        return train_step(row)

    started = time.perf_counter()
    metrics = step()
    first = time.perf_counter() - started
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    rates = [tokens / t for t in times]
    median = statistics.median(rates)
    profile = profile_step(step, model, cuda)
    idle = profile_idle(step) if cuda and args.idle else None
    result = {
        "arch": arch,
        "parameters_trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "first_step_seconds": round(first, 2),
        "median_tokens_per_second": round(median, 1),
        "min_tokens_per_second": round(min(rates), 1),
        "max_tokens_per_second": round(max(rates), 1),
        "spread_percent": round(100 * (max(rates) - min(rates)) / median, 2),
        "median_step_ms": round(1e3 * statistics.median(times), 2),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "loss": round(metrics["loss"], 5),
        "profile_ms": profile,
        **({"idle": idle} if idle is not None else {}),
    }
    print(json.dumps(result), flush=True)
    return result  # the model and optimizer go with this frame, before the next arch


_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_PACKAGE = "speculators_vllm016/"


def _launch_site(frames: list[dict[str, Any]], ops: list[dict[str, Any]], at: float) -> str:
    """Where the host was when it launched the work at `at`: the innermost frame of this
    package (`path(line): function`, e.g. `models/eagle3/attention.py(231):
    document_block_mask`), else the outermost op it was in (autograd's backward thread runs
    no Python of ours)."""
    inside = [f for f in frames if f["ts"] <= at <= f["ts"] + f["dur"] and _PACKAGE in f["name"]]
    if inside:
        return min(inside, key=lambda f: f["dur"])["name"].split(_PACKAGE)[-1]
    enclosing = [o for o in ops if o["ts"] <= at <= o["ts"] + o["dur"]]
    return max(enclosing, key=lambda o: o["dur"])["name"] if enclosing else "(no launch found)"


def attribute_idle(events: list[dict[str, Any]], steps: int, top: int = 15) -> dict[str, Any]:
    """Where the device sat idle in `steps` profiled steps (a Chrome trace's `traceEvents`,
    profiled `with_stack=True`): the gaps between device work, each charged to the launch site
    (`_launch_site`) of the work that ended it, as milliseconds a step; each of the host's waits
    for the device (`cudaStreamSynchronize` and the like) over 20 us, with its site.

    A gap the device waits for the host is time no kernel can win back: the step's floor is its
    kernels plus these gaps, unless the host gets ahead (fewer, larger launches, or the next
    step's host work done while the device still runs this one)."""
    device = sorted(
        (e for e in events if e.get("cat") in _DEVICE_WORK and "dur" in e), key=lambda e: e["ts"]
    )
    if not device:
        return {}
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    frames: dict[Any, list[dict[str, Any]]] = {}
    ops: dict[Any, list[dict[str, Any]]] = {}
    for event in events:
        if "dur" in event and event.get("cat") in ("python_function", "cpu_op"):
            into = frames if event["cat"] == "python_function" else ops
            into.setdefault(event["tid"], []).append(event)
    gaps: dict[str, float] = {}
    idle, busy_until = 0.0, device[0]["ts"] + device[0]["dur"]
    for work in device[1:]:
        if work["ts"] > busy_until:
            gap = work["ts"] - busy_until
            idle += gap
            launch = runtime.get(work.get("args", {}).get("correlation"))
            site = "(no launch found)"
            if launch is not None:
                tid = launch["tid"]
                site = _launch_site(frames.get(tid, []), ops.get(tid, []), launch["ts"])
            gaps[site] = gaps.get(site, 0.0) + gap
        busy_until = max(busy_until, work["ts"] + work["dur"])
    span = busy_until - device[0]["ts"]
    waits = [
        [
            round(e["dur"] / 1e3, 3),
            _launch_site(frames.get(e["tid"], []), ops.get(e["tid"], []), e["ts"]),
        ]
        for e in events
        if e.get("cat") == "cuda_runtime"
        and "Synchronize" in e.get("name", "")
        and e.get("dur", 0) > 20
    ]
    ranked = sorted(gaps.items(), key=lambda item: -item[1])
    return {
        "device_span_ms_per_step": round(span / 1e3 / steps, 3),
        "idle_ms_per_step": round(idle / 1e3 / steps, 3),
        "idle_by_launch_site_ms_per_step": [
            [site, round(us / 1e3 / steps, 3)] for site, us in ranked[:top]
        ],
        "host_waits_ms": sorted(waits, key=lambda w: -w[0])[:top],
    }


def profile_idle(step: Callable[[], Any], steps: int = 2) -> dict[str, Any]:
    """`steps` steps under the profiler with Python stacks; `attribute_idle` of them."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return attribute_idle(events, steps)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/step_profile.py",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", default="kimi-k2.5-draft", choices=sorted(PRESETS))
    parser.add_argument("--packed-tokens", type=int, default=8192)
    parser.add_argument("--archs", nargs="+", choices=("llama", "mla"), default=["llama", "mla"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--output", default=None, help="JSON file for the results")
    parser.add_argument(
        "--idle",
        action="store_true",
        help="also profile 2 steps with Python stacks and charge the GPU's idle gaps to the "
        "code that launched the work ending them (`attribute_idle`; CUDA only)",
    )
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = make_parser().parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[args.preset]
    results = []
    for arch in args.archs:
        results.append(run_arch(args, preset, arch))
        if args.output:
            Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    for result in results:
        print(
            f"{result['arch']}: {result['median_tokens_per_second']:,.0f} tokens/s "
            f"(first step {result['first_step_seconds']} s), ms: "
            f"{ {k: v for k, v in result['profile_ms'].items() if k != 'top_ops_ms'} }"
        )
    return results


if __name__ == "__main__":
    main()
