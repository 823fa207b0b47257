"""The trainer's offline loader alone (no step), several epochs, old code beside new (#28).

    python benchmarks/loader.py --hidden 1024 --sample-tokens 2048 --num-workers 2 --samples 64

Writes `--samples` synthetic sample files (datagen's layout, bf16, 4 captured layers of
`--hidden`), more than the loader prefetches (`--num-workers` x `--prefetch-factor` rows), then
iterates the loader the trainer builds over `--epochs` epochs, `--repeats` times, once per variant,
each in its own process:

- `old`: the package at `--old-ref` (git archive of this repository; default e057f76, before #28):
  noise, fp32 conversion and finiteness check on the CPU in the workers, workers restarted each
  epoch;
- `new`: this checkout's `SampleFileLoader` (bf16 rows, persistent workers); its noise is drawn on
  the training device inside the step, so it is not in these figures;
- `new-cpu-noise`: the same rows noised in the main process, as a CPU-only run does.

Per epoch: tokens/s (packed tokens over the epoch's wall time, the epoch start included), the
epoch-boundary time (from `iter(loader)` to the first row) and the slowest waits for a row; then
median and spread over the repeats. JSON goes to `--output`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("old", "new", "new-cpu-noise")


def write_files(folder: Path, samples: int, tokens: int, hidden: int) -> None:
    """`samples` files of `tokens` tokens; four random bf16 layers shared by all (values do not
    change the cost), ids differ per file."""
    import torch

    from speculators_vllm016.data_generation.sample_io import write_sample

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randn(tokens, hidden, generator=generator).bfloat16() for _ in range(4)]
    mask = torch.ones(tokens, dtype=torch.long)
    mask[: tokens // 10] = 0
    for index in range(samples):
        path = folder / f"data_{index}.pt"
        if not path.is_file():
            ids = torch.randint(0, 32_000, (tokens,), generator=generator)
            write_sample(path, {"input_ids": ids, "hidden_states": layers, "loss_mask": mask})


def build_loader(args: argparse.Namespace, variant: str) -> tuple[Any, Any, Any]:
    """The loader as `speculators train` builds it offline (job.py), for the imported package."""
    import torch

    from speculators_vllm016.train import data as data_module
    from speculators_vllm016.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )
    from speculators_vllm016.train.noise_transforms import AddGaussianNoise

    try:  # its home since the split of train/data.py; before, train/data.py; before #28, none
        from speculators_vllm016.train.loading.sample_loader import SampleFileLoader
    except ImportError:
        SampleFileLoader = getattr(data_module, "SampleFileLoader", None)  # noqa: N806
    new = SampleFileLoader is not None
    if new != (variant != "old"):
        raise SystemExit(f"variant {variant} imported the {'new' if new else 'old'} package")
    files = data_module.list_files(args.data)
    options: dict[str, Any] = {"device_noise": True} if new else {}
    dataset = data_module.Eagle3SampleFileDataset(
        args.total_seq_len,
        file_list=[str(f) for f in files],
        transform=AddGaussianNoise(0.05),
        seed=0,
        output_dtype=torch.bfloat16,
        widths=(3 * args.hidden, args.hidden),
        **options,
    )
    sampler = MultipackDistributedBatchSamplerV2(args.total_seq_len, dataset.lengths, 1, 0, seed=0)
    loader_class = SampleFileLoader if new else torch.utils.data.DataLoader
    workers = args.num_workers
    extra = {"persistent_workers": workers > 0} if new else {}
    loader = loader_class(
        dataset,
        batch_sampler=sampler,
        collate_fn=data_module.create_collate_fn(args.total_seq_len),
        num_workers=workers,
        prefetch_factor=args.prefetch_factor if workers else None,
        pin_memory=False,
        **extra,
    )
    return loader, sampler, dataset


def child(args: argparse.Namespace) -> None:
    """One variant in this process: per repeat a fresh loader, per epoch the figures."""
    import torch

    runs = []
    for _ in range(args.repeats):
        loader, sampler, dataset = build_loader(args, args.child)
        epochs = []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            dataset.set_epoch(epoch)
            started = time.perf_counter()
            rows = iter(loader)
            waits, tokens, last = [], 0, started
            for row in rows:
                if args.child == "new-cpu-noise":
                    from speculators_vllm016.train.loading.device_rows import to_step_row

                    to_step_row(row, torch.device("cpu"), None)
                now = time.perf_counter()
                waits.append(now - last)
                tokens += int(row["lengths"].sum())
                last = time.perf_counter()
            seconds = last - started
            epochs.append(
                {
                    "epoch": epoch,
                    "rows": len(waits),
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_second": tokens / seconds,
                    "epoch_boundary_seconds": waits[0] if waits else None,
                    "slowest_waits_after_first": sorted(waits[1:], reverse=True)[:3],
                }
            )
        runs.append(epochs)
        del loader
    print("RESULT " + json.dumps(runs), flush=True)


def summarize(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per epoch: median and spread (min, max) over the repeats."""
    summary = []
    for epoch in range(len(runs[0])):
        rates = [run[epoch]["tokens_per_second"] for run in runs]
        starts = [run[epoch]["epoch_boundary_seconds"] for run in runs]
        waits = [max(run[epoch]["slowest_waits_after_first"], default=0.0) for run in runs]
        summary.append(
            {
                "epoch": epoch,
                "tokens_per_second": {
                    "median": statistics.median(rates),
                    "min": min(rates),
                    "max": max(rates),
                },
                "epoch_boundary_seconds": {
                    "median": statistics.median(starts),
                    "min": min(starts),
                    "max": max(starts),
                },
                "max_wait_after_first_seconds": {
                    "median": statistics.median(waits),
                    "max": max(waits),
                },
            }
        )
    return summary


def old_package(ref: str, folder: Path) -> Path:
    """The package at `ref`, extracted from git (its import path)."""
    target = folder / f"code-{ref}"
    if not (target / "speculators_vllm016").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", ref, "speculators_vllm016", "speculators"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "loader-bench"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--sample-tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--total-seq-len", type=int, default=8192)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--prefetch-factor", type=int, default=4, help="the trainer's default")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["old", "new"])
    parser.add_argument("--old-ref", default="e057f76")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads per process (default: torch's)",
    )
    parser.add_argument(
        "--output", default=None, help="JSON path (default: <work-dir>/loader.json)"
    )
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.child:
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        child(args)
        return {}
    work = Path(args.work_dir)
    data = work / f"data-{args.samples}x{args.sample_tokens}x{args.hidden}"
    sys.path.insert(0, str(ROOT))
    write_files(data, args.samples, args.sample_tokens, args.hidden)
    window = args.num_workers * args.prefetch_factor * (args.total_seq_len // args.sample_tokens)
    if args.samples <= window:
        print(f"warning: {args.samples} samples fit in the prefetch window ({window})", flush=True)
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "data")},
        "variants": {},
    }
    for variant in args.variants:
        code = old_package(args.old_ref, work) if variant == "old" else ROOT
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            variant,
            "--data",
            str(data),
            *(argv if argv is not None else sys.argv[1:]),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT)])}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
        runs = json.loads(lines[-1][len("RESULT ") :])
        result["variants"][variant] = {"runs": runs, "per_epoch": summarize(runs)}
        for row in result["variants"][variant]["per_epoch"]:
            rate, start, wait = (
                row["tokens_per_second"],
                row["epoch_boundary_seconds"],
                row["max_wait_after_first_seconds"],
            )
            print(
                f"{variant:14s} epoch {row['epoch']}: {rate['median']:9,.0f} tokens/s "
                f"[{rate['min']:,.0f}-{rate['max']:,.0f}]  first row {start['median']:.2f} s "
                f"[{start['min']:.2f}-{start['max']:.2f}]  slowest later wait "
                f"{wait['median']:.2f} s (max {wait['max']:.2f})",
                flush=True,
            )
    output = Path(args.output) if args.output else work / "loader.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main()
