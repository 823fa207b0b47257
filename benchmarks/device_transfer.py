"""GPU -> shared-memory transfer of captured hidden states, measured alone with plain torch.

The generator's worker copies every captured layer's rows into per-request shared-memory files.
This script measures that piece without vLLM, on one GPU, in one process:

- `limit`: pinned-memory D2H bandwidth of one big async copy (the host-copy ceiling);
- `sync`: the old path, `rows.to("cpu")` then a scatter into the shared buffers, all blocking;
- `rowwriter`: `RowWriter` (async copy on a side stream into pinned staging, scatter on a thread).

and, with a matmul workload standing in for the decoder layers, how much each path slows the
"forward": the ratio of compute+transfer time to compute-only time. Also checks correctness.

    python benchmarks/device_transfer.py --hidden 7168 --tokens 8192 --layers 4 --steps 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculators_vllm016.data_generation.device_transfer import RowTarget, RowWriter  # noqa: E402
from speculators_vllm016.data_generation.transfer import default_transfer_root  # noqa: E402


def shared_buffers(count: int, rows: int, hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-request host buffers mapped from /dev/shm files, as the generator uses them."""
    buffers = []
    for index in range(count):
        path = default_transfer_root() / f"speculators-bench-{index}.bin"
        nbytes = rows * hidden * torch.empty((), dtype=dtype).element_size()
        with open(path, "wb") as handle:
            handle.truncate(nbytes)
        tensor = torch.from_file(str(path), shared=True, size=rows * hidden, dtype=dtype)
        path.unlink()  # the mapping stays valid
        buffers.append(tensor.view(rows, hidden))
    return buffers


def make_targets(buffers: list[torch.Tensor], rows_per_request: int) -> list[RowTarget]:
    return [
        RowTarget(buffer[:rows_per_request], index * rows_per_request, rows_per_request)
        for index, buffer in enumerate(buffers)
    ]


def copy_sync(source: torch.Tensor, targets: list[RowTarget]) -> None:
    host = source.to("cpu")
    for target in targets:
        target.destination.copy_(host[target.row : target.row + target.count])


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size (Kimi-K2.5: 7168)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per forward step")
    parser.add_argument("--layers", type=int, default=4, help="captured layers")
    parser.add_argument("--requests", type=int, default=16, help="requests per step")
    parser.add_argument("--steps", type=int, default=10, help="forward steps per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compute-matmuls", type=int, default=6, help="matmuls per layer")
    parser.add_argument("--json", type=str, default=None, help="write results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")

    dtype = torch.bfloat16
    device = torch.device("cuda")
    rows_per_request = args.tokens // args.requests
    tokens = rows_per_request * args.requests
    layer_bytes = tokens * args.hidden * 2
    step_bytes = layer_bytes * args.layers
    sources = [
        torch.randn(tokens, args.hidden, device=device, dtype=dtype) for _ in range(args.layers)
    ]
    buffers = shared_buffers(args.requests, rows_per_request, args.hidden, dtype)
    targets = make_targets(buffers, rows_per_request)
    weight = torch.randn(args.hidden, args.hidden, device=device, dtype=dtype) / args.hidden**0.5

    # Correctness of the async path into shared memory.
    writer = RowWriter()
    writer.write_rows(sources[0], targets)
    writer.flush()
    expected = sources[0].cpu()
    for target in targets:
        assert torch.equal(target.destination, expected[target.row : target.row + target.count])

    pinned = torch.empty(tokens, args.hidden, dtype=dtype, pin_memory=True)

    def limit() -> None:
        for _ in range(args.steps * args.layers):
            pinned.copy_(sources[0], non_blocking=True)

    def transfer_only(path: str):
        def run() -> None:
            for _ in range(args.steps):
                for layer in range(args.layers):
                    if path == "sync":
                        copy_sync(sources[layer], targets)
                    else:
                        writer.write_rows(sources[layer], targets)
            if path == "rowwriter":
                writer.flush()

        return run

    def forward(path: str | None):
        def run() -> None:
            hidden = sources[0]
            for _ in range(args.steps):
                for _layer in range(args.layers):
                    for _ in range(args.compute_matmuls):
                        hidden = torch.tanh(hidden @ weight)
                    if path == "sync":
                        copy_sync(hidden, targets)
                    elif path == "rowwriter":
                        writer.write_rows(hidden, targets)
            if path == "rowwriter":
                writer.flush()

        return run

    for fn in (limit, transfer_only("sync"), transfer_only("rowwriter"), forward(None)):
        fn()  # warm-up: allocator, pinned pool, thread
    results: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "settings": vars(args),
        "bytes_per_step": step_bytes,
    }
    total = step_bytes * args.steps
    for name, fn in (
        ("limit", limit),
        ("sync", transfer_only("sync")),
        ("rowwriter", transfer_only("rowwriter")),
    ):
        seconds = statistics.median(timed(fn, args.repeats))
        results[f"{name}_GBps"] = round(total / seconds / 1e9, 2)
    compute = statistics.median(timed(forward(None), args.repeats))
    for name in ("sync", "rowwriter"):
        seconds = statistics.median(timed(forward(name), args.repeats))
        results[f"forward_slowdown_{name}"] = round(seconds / compute, 3)
    results["forward_compute_only_s"] = round(compute, 4)
    writer.close()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
