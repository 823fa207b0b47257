"""bf16 vs fp8 storage of hidden states (`--storage-dtype`, issue #40): what it saves, what it costs.

For each target (the demo's Llama, and a tiny DeepSeek-V3 taught on the same conversations):
datagen writes the same rows with `--storage-dtype bf16` and `fp8` (`--repeats` times each,
alternating, for tokens/s: median and spread); the bytes per token come from the files; the
fidelity of the training target (the verifier's distribution from the last layer, stored as fp8
vs bf16) is compared; then one draft per storage dtype and seed is trained with the same steps
and evaluated on held-out prompts (`speculators eval`'s `run_evaluation`, hf engine): tau and
tau_sim, per seed and as mean +- spread. CPU only; a small run by default.

    python benchmarks/storage_dtype.py --output-dir /tmp/storage-dtype [--seeds 0 1 2]

Writes `storage-dtype-<date>.json` and `.md` under `--results-dir` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
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


def build_targets(root: Path, which: list[str], deepseek_positions: int = 1024) -> dict[str, Path]:
    """The taught targets, built once under `root` (reused when there). `deepseek_positions`:
    the tiny DeepSeek-V3's `max_position_embeddings` (its RoPE is plain, so only the limit on
    prompt length changes; `benchmarks/draft_tau.py` asks 2048 for its long prompts)."""
    from speculators_vllm016.demo import build_demo_model, demo_conversations_path
    from speculators_vllm016.demo.target import TargetTraining, train_demo_target

    targets: dict[str, Path] = {}
    if "demo-llama" in which:
        initial = build_demo_model(root / "demo-llama-init")
        targets["demo-llama"] = train_demo_target(
            initial,
            root / "demo-llama",
            demo_conversations_path(),
            TargetTraining(steps=40, row_tokens=128, rows_per_step=8, show_progress=False),
        ).path
    if "deepseek-v3" in which:
        from tests.tiny_models import build_taught_tiny_deepseek_v3

        targets["deepseek-v3"] = build_taught_tiny_deepseek_v3(
            root / "deepseek-v3", max_position_embeddings=deepseek_positions
        )
    return targets


def run_datagen(
    target: Path,
    output: Path,
    storage: str,
    args: argparse.Namespace,
    conversations: Path | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """Datagen of `args.samples` rows of `conversations` (default: the demo's) into `output` with
    the engine in `dtype`, hidden states stored as `storage`; its rate and bytes per token."""
    from speculators_vllm016.data_generation.offline import run_datagen as datagen
    from speculators_vllm016.data_generation.options import (
        DatagenOptions,
        EngineOptions,
        OutputOptions,
        PreprocessingOptions,
    )
    from speculators_vllm016.demo import demo_conversations_path

    summary = datagen(
        DatagenOptions(
            engine=EngineOptions(target_model_path=str(target), dtype=dtype),
            preprocessing=PreprocessingOptions(
                train_data_path=str(conversations or demo_conversations_path()),
                seq_length=512,
                max_samples=args.samples,
                hf_cache_dir=str(output.parent / "hf-cache"),
                num_preprocessing_workers=1,
            ),
            output=OutputOptions(
                output_dir=str(output), storage_dtype=storage, show_progress=False
            ),
        )
    )
    files = sorted(output.glob("data_*.pt"))
    size = sum(f.stat().st_size for f in files)
    return {
        "tokens_per_second": summary.tokens_per_second,
        "tokens": summary.tokens_extracted,
        "bytes": size,
        "bytes_per_token": size / max(summary.tokens_extracted, 1),
    }


def target_fidelity(target: Path, bf16_folder: Path) -> dict[str, float]:
    """The training target from the last layer stored as fp8 vs as bf16: top-1 agreement and
    KL(bf16 || fp8) of the verifier's distribution; the fused layers' relative error."""
    from transformers import AutoModelForCausalLM

    from speculators_vllm016.data_generation.sample_io import (
        dequantized_sample,
        load_sample,
        quantized_sample,
    )

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    norm, head = model.model.norm, model.lm_head
    agree, kl, tokens, fused_error = 0, 0.0, 0, []
    with torch.no_grad():
        for path in sorted(bf16_folder.glob("data_*.pt"))[:40]:
            sample = load_sample(path)
            back = dequantized_sample(quantized_sample(sample))
            exact = torch.log_softmax(head(norm(sample["hidden_states"][-1].float())), -1)
            approx = torch.log_softmax(head(norm(back["hidden_states"][-1].float())), -1)
            agree += int((exact.argmax(-1) == approx.argmax(-1)).sum())
            kl += float((exact.exp() * (exact - approx)).sum())
            tokens += exact.shape[0]
            for a, b in zip(sample["hidden_states"][:-1], back["hidden_states"][:-1], strict=True):
                fused_error.append(float((a.float() - b.float()).norm() / a.float().norm()))
    return {
        "top1_agreement": agree / tokens,
        "mean_kl": kl / tokens,
        "fused_relative_error": statistics.mean(fused_error),
        "tokens": tokens,
    }


def draft_job(target: Path, data: Path, vocab: Path, folder: Path, seed: int, epochs: int):
    """The training job of one draft: the demo's (`demo.draft_training.train_config`, its one
    home) with this benchmark's schedule (the demo's lr and row length, written out so that the
    results stay comparable if the demo's defaults change); `data` and `vocab` are linked into
    the draft's lane `folder`."""
    from speculators_vllm016.demo.draft_training import DraftLane, train_config
    from speculators_vllm016.demo.options import DemoOptions

    options = DemoOptions(
        epochs=epochs, lr=1e-3, total_seq_len=2048, seed=seed, show_progress=False
    )
    lane = DraftLane(folder)
    lane.folder.mkdir(parents=True, exist_ok=True)
    for link, source in ((lane.data, data), (lane.vocab, vocab)):
        if not link.is_symlink():
            link.symlink_to(source.resolve(), target_is_directory=True)
    return train_config(options, lane, target)


def train_and_eval(target: Path, folders: dict[str, Path], root: Path, args) -> dict[str, Any]:
    """One draft per (storage, seed), same steps; all evaluated in one run on held-out prompts."""
    from transformers import AutoConfig

    from speculators_vllm016.data_generation.token_counts import load_token_freq
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation
    from speculators_vllm016.train.jobs.job import run_train_job
    from speculators_vllm016.train.vocab_maps import write_vocab_mappings_from_counts

    vocab = root / "vocab"
    write_vocab_mappings_from_counts(
        load_token_freq(folders["bf16"]),
        256,
        int(AutoConfig.from_pretrained(target).vocab_size),
        vocab,
    )
    drafts, labels = [], []
    for seed in args.seeds:
        for storage, folder in folders.items():
            config = draft_job(
                target, folder, vocab, root / f"draft-{storage}-seed{seed}", seed, args.epochs
            )
            run_train_job(config)
            drafts.append(str(Path(config.checkpoint.save_path) / str(args.epochs - 1)))
            labels.append(f"{storage}-seed{seed}")
    report = run_evaluation(
        EvalOptions(
            drafts=drafts,
            data_path=str(demo_conversations_path()),
            verifier=str(target),
            max_prompts=args.eval_prompts,
            max_new_tokens=args.max_new_tokens,
            engine="hf",
            device="cpu",
            hf_cache_dir=str(root / "hf-cache"),
            show_progress=False,
            labels=labels,
        )
    )
    per_draft = {
        label: {
            "tau": draft.counts.acceptance_length,
            "tau_sim": draft.training.tau_sim if draft.training else None,
        }
        for label, draft in zip(labels, report.drafts, strict=True)
    }
    summary = {}
    for storage in folders:
        taus = [v["tau"] for k, v in per_draft.items() if k.startswith(storage)]
        sims = [v["tau_sim"] for k, v in per_draft.items() if k.startswith(storage)]
        summary[storage] = {
            "tau_mean": statistics.mean(taus),
            "tau_spread": max(taus) - min(taus),
            "tau_sim_mean": statistics.mean(sims),
            "tau_sim_spread": max(sims) - min(sims),
        }
    return {"drafts": per_draft, "summary": summary, "prompts": report.num_prompts}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# bf16 vs fp8 storage of hidden states ({result['date']})",
        "",
        f"Command: `{result['command']}`",
        "",
        "| target | storage | bytes/token | datagen tokens/s (median, spread) | tau (mean +- spread) "
        "| tau_sim (mean +- spread) |",
        "|---|---|---|---|---|---|",
    ]
    for name, model in result["targets"].items():
        for storage in ("bf16", "fp8"):
            runs = model["datagen"][storage]
            rates = [r["tokens_per_second"] for r in runs]
            quality = model.get("quality", {}).get("summary", {}).get(storage, {})
            tau = f"{quality['tau_mean']:.3f} +- {quality['tau_spread']:.3f}" if quality else "-"
            sim = (
                f"{quality['tau_sim_mean']:.3f} +- {quality['tau_sim_spread']:.3f}"
                if quality
                else "-"
            )
            lines.append(
                f"| {name} | {storage} | {runs[0]['bytes_per_token']:.0f} | "
                f"{statistics.median(rates):.0f} ({min(rates):.0f}..{max(rates):.0f}) | {tau} | {sim} |"
            )
    lines += ["", "Fidelity of the training target (last layer stored as fp8 vs bf16):", ""]
    lines += [
        "| target | top-1 agreement | mean KL | fused layers' relative error |",
        "|---|---|---|---|",
    ]
    for name, model in result["targets"].items():
        f = model["fidelity"]
        lines.append(
            f"| {name} | {f['top1_agreement']:.4f} | {f['mean_kl']:.2e} | "
            f"{f['fused_relative_error']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="/tmp/storage-dtype", help="work folder")
    parser.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--targets", nargs="+", default=["demo-llama", "deepseek-v3"])
    parser.add_argument("--samples", type=int, default=96, help="conversations datagen reads")
    parser.add_argument("--repeats", type=int, default=2, help="datagen runs per storage dtype")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--skip-quality", action="store_true", help="no training or eval")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/storage_dtype.py", *(argv or sys.argv[1:])]),
        "settings": vars(args),
        "targets": {},
    }
    for name, target in build_targets(root / "targets", args.targets).items():
        model: dict[str, Any] = {"datagen": {"bf16": [], "fp8": []}}
        folders = {}
        for repeat in range(args.repeats):
            for storage in ("bf16", "fp8"):
                folder = root / name / f"data-{storage}-{repeat}"
                if folder.exists():
                    import shutil

                    shutil.rmtree(folder)
                started = time.perf_counter()
                run = run_datagen(target, folder, storage, args)
                run["seconds_in_all"] = time.perf_counter() - started
                model["datagen"][storage].append(run)
                folders.setdefault(storage, folder)
                print(name, storage, repeat, json.dumps(run), flush=True)
        model["fidelity"] = target_fidelity(target, folders["bf16"])
        print(name, "fidelity", json.dumps(model["fidelity"]), flush=True)
        if not args.skip_quality:
            model["quality"] = train_and_eval(target, folders, root / name, args)
            print(name, "quality", json.dumps(model["quality"]["summary"]), flush=True)
        result["targets"][name] = model
        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
        stem = Path(args.results_dir) / f"storage-dtype-{result['date'].replace('-', '')}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
