"""EAGLE-3.1 (`--fc-norm --norm-output`) vs EAGLE-3.0 on the demo's taught tiny Llama (issue #47).

One datagen run on the demo's conversations; per seed, one 3.0 and one 3.1 draft trained with
the same data, vocabulary, steps and seed (`--ttt-steps 6`, so that both are trained for the
deepest proposal measured); then every draft is evaluated on held-out prompts with the `hf`
engine (`speculators eval`'s `run_evaluation`) proposing k = 3 and k = 6 tokens: tau per draft,
and per variant the median and the spread (min..max) over the seeds, with the per-seed
difference 3.1 - 3.0. CPU only; a small run by default.

    flock /tmp/vllm-engine.lock python benchmarks/eagle31.py --output-dir /tmp/eagle31 --only-data
    python benchmarks/eagle31.py --output-dir /tmp/eagle31 [--seeds 0 1 2]

Writes `eagle31-demo-<date>.json` and `.md` under `--results-dir` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = {"3.0": {}, "3.1": {"fc_norm": True, "norm_output": True}}


def build_target(root: Path) -> Path:
    """The demo's tiny Llama taught on the demo's conversations (reused when there)."""
    from speculators_vllm016.demo import build_demo_model, demo_conversations_path
    from speculators_vllm016.demo.target import TargetTraining, train_demo_target

    initial = build_demo_model(root / "demo-llama-init")
    return train_demo_target(
        initial,
        root / "demo-llama",
        demo_conversations_path(),
        TargetTraining(steps=40, row_tokens=128, rows_per_step=8, show_progress=False),
    ).path


def run_datagen(target: Path, output: Path, samples: int) -> Path:
    from speculators_vllm016.data_generation.offline import run_datagen as datagen
    from speculators_vllm016.data_generation.options import (
        DatagenOptions,
        EngineOptions,
        OutputOptions,
        PreprocessingOptions,
    )
    from speculators_vllm016.demo import demo_conversations_path

    if not any(output.glob("data_*.pt")):
        datagen(
            DatagenOptions(
                engine=EngineOptions(target_model_path=str(target), dtype="float32"),
                preprocessing=PreprocessingOptions(
                    train_data_path=str(demo_conversations_path()),
                    seq_length=512,
                    max_samples=samples,
                    hf_cache_dir=str(output.parent / "hf-cache"),
                    num_preprocessing_workers=1,
                ),
                output=OutputOptions(output_dir=str(output), show_progress=False),
            )
        )
    return output


def train(target: Path, data: Path, vocab: Path, save: Path, seed: int, variant: str, args):
    from speculators_vllm016.train.jobs.job import run_train_job
    from speculators_vllm016.train.jobs.job_config import (
        CheckpointConfig,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        RuntimeConfig,
        TrainingConfig,
        TrainJobConfig,
        VocabConfig,
    )
    from speculators_vllm016.train.vocab_maps import D2T_FILE, T2D_FILE

    last = save / str(args.epochs - 1)
    if not (last / "model.safetensors").is_file():
        run_train_job(
            TrainJobConfig(
                model=ModelConfig(
                    verifier_name_or_path=str(target), ttt_steps=6, **VARIANTS[variant]
                ),
                data=DataConfig(data_path=str(data)),
                vocab=VocabConfig(d2t_path=str(vocab / D2T_FILE), t2d_path=str(vocab / T2D_FILE)),
                checkpoint=CheckpointConfig(save_path=str(save)),
                training=TrainingConfig(epochs=args.epochs, lr=1e-3, total_seq_len=2048, seed=seed),
                runtime=RuntimeConfig(num_workers=0, device="cpu"),
                logging=LoggingConfig(log_dir=str(save / "logs"), no_progress=True),
            )
        )
    return last


def evaluate(target: Path, drafts: list[str], labels: list[str], k: int, root: Path, args):
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation

    report = run_evaluation(
        EvalOptions(
            drafts=drafts,
            data_path=str(demo_conversations_path()),
            verifier=str(target),
            max_prompts=args.eval_prompts,
            max_new_tokens=args.max_new_tokens,
            num_speculative_tokens=k,
            engine="hf",
            device="cpu",
            hf_cache_dir=str(root / "hf-cache"),
            show_progress=False,
            labels=labels,
        )
    )
    return {
        label: draft.counts.acceptance_length
        for label, draft in zip(labels, report.drafts, strict=True)
    }


def summarize(taus: dict[str, float], seeds: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        values = [taus[f"{variant}-seed{seed}"] for seed in seeds]
        out[variant] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    diffs = [taus[f"3.1-seed{s}"] - taus[f"3.0-seed{s}"] for s in seeds]
    out["3.1 - 3.0"] = {"median": statistics.median(diffs), "min": min(diffs), "max": max(diffs)}
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# EAGLE-3.1 vs 3.0 on the demo target ({result['date']})",
        "",
        f"Seeds {result['seeds']}, {result['epochs']} epoch(s) of {result['samples']} "
        f"conversations, --ttt-steps 6, {result['prompts']} held-out prompts, greedy, hf engine.",
        "",
        "| k | variant | tau median | min..max |",
        "| --- | --- | --- | --- |",
    ]
    for k, summary in result["summary"].items():
        for variant, stats in summary.items():
            lines.append(
                f"| {k} | {variant} | {stats['median']:.3f} | "
                f"{stats['min']:.3f}..{stats['max']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="/tmp/eagle31", help="work folder")
    parser.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--samples", type=int, default=96, help="conversations datagen reads")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--only-data",
        action="store_true",
        help="stop after datagen (the one part that starts a vLLM engine; run it under the "
        "shared engine lock, the rest without)",
    )
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from speculators_vllm016.data_generation.token_counts import load_token_freq
    from speculators_vllm016.train.vocab_maps import write_vocab_mappings_from_counts

    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = build_target(root)
    data = run_datagen(target, root / "data", args.samples)
    if args.only_data:
        return 0
    vocab = root / "vocab"
    vocab_size = int(AutoConfig.from_pretrained(target).vocab_size)
    write_vocab_mappings_from_counts(load_token_freq(data), 256, vocab_size, vocab)
    drafts, labels = [], []
    for seed in args.seeds:
        for variant in VARIANTS:
            save = root / f"draft-{variant}-seed{seed}"
            drafts.append(str(train(target, data, vocab, save, seed, variant, args)))
            labels.append(f"{variant}-seed{seed}")
    taus = {k: evaluate(target, drafts, labels, k, root, args) for k in (3, 6)}
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "seeds": args.seeds,
        "epochs": args.epochs,
        "samples": args.samples,
        "prompts": args.eval_prompts,
        "tau": taus,
        "summary": {k: summarize(t, args.seeds) for k, t in taus.items()},
    }
    results = Path(args.results_dir)
    stem = f"eagle31-demo-{datetime.now(timezone.utc).strftime('%Y%m%d')}"
    (results / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (results / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
