"""How long the step loop waits for a checkpoint: written in the loop vs in the background.

    python benchmarks/checkpoint_wait.py [--params-millions 64] [--repeats 3] [--device cpu]

One model of `--params-millions` fp32 trained weights (square linear layers) after one AdamW step
is checkpointed with the trainer's checkpointer, `--repeats` times each way, alternating: `loop`
(`background=False`, what the trainer did before issue #48: the loop waits for every file) and
`background` (the loop waits for a snapshot, a thread writes). Per save: the seconds until
`save` returned (what the step loop waits) and until the checkpoint was in place; median and
spread (min-max) over the repeats. Between saves the weights change in place, as training would.
The files go to `--work-dir` (deleted after each save: only the timing is kept).

Writes `checkpoint-wait-<device>-<date>.json` under `--results-dir` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class Weights(torch.nn.Module):
    """`layers` square fp32 linear layers: a stand-in whose only job is its size."""

    def __init__(self, params: int, width: int = 2048) -> None:
        super().__init__()
        layers = max(1, params // (width * width))
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width, bias=False) for _ in range(layers)
        )

    def save_pretrained(self, folder: str | Path, state_dict: dict, **_: Any) -> None:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in state_dict.items()},
            str(Path(folder) / "model.safetensors"),
        )
        (Path(folder) / "config.json").write_text("{}")


def _trained(params: int, device: str) -> tuple[Weights, torch.optim.Optimizer]:
    model = Weights(params).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    return model, optimizer


def time_save(saver: Any, model: Weights, optimizer: Any, name: str) -> tuple[float, float]:
    """(seconds until `save` returned, seconds until the checkpoint was in place)."""
    from speculators_vllm016.train.checkpointer import TrainingState

    if model.layers[0].weight.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    saver.save(name, model, optimizer, None, TrainingState(global_step=1))
    returned = time.perf_counter() - started
    with torch.no_grad():  # the next steps change the weights in place
        for parameter in model.parameters():
            parameter.add_(1.0)
    saver.wait()
    return returned, time.perf_counter() - started


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--work-dir", default="/tmp/checkpoint-wait")
    parser.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    from benchmarks.training import environment
    from speculators_vllm016.train.checkpointer import SingleGPUCheckpointer

    model, optimizer = _trained(int(args.params_millions * 1e6), args.device)
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    savers = {
        "loop": SingleGPUCheckpointer(work / "loop", background=False),
        "background": SingleGPUCheckpointer(work / "background", background=True),
    }
    times: dict[str, dict[str, list[float]]] = {
        kind: {"loop_wait_s": [], "write_s": []} for kind in savers
    }
    for repeat in range(args.repeats):
        for kind, saver in savers.items():  # alternating: the disk's state drifts alike
            waited, written = time_save(saver, model, optimizer, f"0-step{repeat}")
            times[kind]["loop_wait_s"].append(waited)
            times[kind]["write_s"].append(written)
            shutil.rmtree(saver.path / f"0-step{repeat}", ignore_errors=True)
            print(f"{kind} repeat {repeat}: loop waited {waited:.3f} s, written in {written:.2f} s")
    size = sum(p.numel() for p in model.parameters())
    result = {
        "command": "python benchmarks/checkpoint_wait.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "parameters": size,
        "checkpoint_gb": round(size * (2 + 4 + 8) / 1e9, 3),  # bf16 served, fp32 master, moments
        "device": args.device,
        "repeats": args.repeats,
        "environment": environment(),
        "runs": {
            kind: {name: summary(values) | {"each": values} for name, values in numbers.items()}
            for kind, numbers in times.items()
        },
    }
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"checkpoint-wait-{args.device}-{result['date'].replace('-', '')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for kind, numbers in result["runs"].items():
        wait, write = numbers["loop_wait_s"], numbers["write_s"]
        print(
            f"{kind}: loop waits {wait['median']} s ({wait['min']}-{wait['max']}), "
            f"in place after {write['median']} s ({write['min']}-{write['max']})"
        )
    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
