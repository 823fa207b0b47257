"""Acceptance length (tau) of draft variants side by side: MLA vs Llama layer, EAGLE-3.1 vs 3.0 (#47).

Two taught tiny targets (`storage_dtype.build_targets`): the demo's Llama and a DeepSeek-V3
(7 layers, MLA, MoE; 2048 positions here so that the long prompts fit). The demo's split of its
conversations (`demo.held_out`: every 6th opening question held out) gives the draft rows and
the held-out prompts. Per target, one datagen run of the draft rows (`storage_dtype.run_datagen`,
float32 engine) and one vocabulary map feed every draft trained on that target; each draft is
the demo's training job (`demo.draft_training.train_config`) with only the arm's model switches,
the seed and `--ttt-steps 6` (so that k = 6 is trained for) changed. The arms:

- demo-llama: `3.0` (the Llama-layer draft) and `3.1` (`--fc-norm --norm-output`);
- deepseek-v3: `llama` (3.0), `mla` (`--draft-arch mla`, 3.0) and `llama-3.1`.

Every draft of a target is evaluated in one `speculators eval --engine hf` run per k
(`run_evaluation`: greedy speculative decoding, the verifier in float32) on the held-out
questions alone (context 0) and after ~`--context-lengths` tokens of earlier turns
(`evaluate.context_prompts`). Per (target, k, context, arm): tau median and min..max over the
seeds; per comparison the per-seed difference, median and min..max.

The parts run apart, each reusing what the earlier ones wrote under `--work`:

    nice -n 10 python benchmarks/draft_tau.py --work W --stage targets
    flock /tmp/vllm-engine.lock nice -n 10 python benchmarks/draft_tau.py --work W --stage data
    nice -n 10 python benchmarks/draft_tau.py --work W --stage train
    nice -n 10 python benchmarks/draft_tau.py --work W --stage eval --output-stem NAME

`--stage data` is the only part that starts a vLLM engine. Several `--stage train` processes may
share the drafts (each takes a draft whose folder does not exist yet); a draft whose training
was killed keeps its folder and is skipped until that folder is removed. `eval` writes `NAME.json` and
`NAME.md` under `--results-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EAGLE31 = {"fc_norm": True, "norm_output": True}
ARMS: dict[str, dict[str, dict[str, Any]]] = {
    "demo-llama": {"3.0": {}, "3.1": EAGLE31},
    "deepseek-v3": {"llama": {}, "mla": {"draft_arch": "mla"}, "llama-3.1": EAGLE31},
}
# (target, arm compared, baseline arm): reported as per-seed differences.
COMPARISONS = [
    ("deepseek-v3", "mla", "llama"),
    ("demo-llama", "3.1", "3.0"),
    ("deepseek-v3", "llama-3.1", "llama"),
]
TTT_STEPS = 6
DRAFT_VOCAB = 256
HELD_OUT_EVERY = 6


def split_files(work: Path, draft_rows: int) -> dict[str, Path]:
    """The demo's split of its conversations (the drafts' rows and the held-out questions)."""
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.held_out import split_of_file, write_split

    lines, split = split_of_file(demo_conversations_path(), HELD_OUT_EVERY, draft_rows)
    return write_split(lines, split, work / "split")


def lane_of(work: Path, target: str):
    """Where a target's data and vocabulary go (the demo's layout); drafts go under runs/."""
    from speculators_vllm016.demo.draft_training import DraftLane

    return DraftLane(work / target)


def stage_data(work: Path, targets: dict[str, Path], args: argparse.Namespace) -> None:
    """Datagen of the draft rows once per target, then its vocabulary map."""
    from transformers import AutoConfig

    from benchmarks.storage_dtype import run_datagen
    from speculators_vllm016.data_generation.token_counts import load_token_freq
    from speculators_vllm016.demo.held_out import DRAFT_FILE
    from speculators_vllm016.train.vocab_maps import write_vocab_mappings_from_counts

    drafts_file = split_files(work, args.draft_rows)[DRAFT_FILE]
    for name, target in targets.items():
        lane = lane_of(work, name)
        if not any(lane.data.glob("data_*.pt")):
            samples = argparse.Namespace(samples=None)
            run = run_datagen(target, lane.data, "bf16", samples, drafts_file, "float32")
            print(name, "datagen", json.dumps(run), flush=True)
        vocab_size = int(AutoConfig.from_pretrained(target).vocab_size)
        write_vocab_mappings_from_counts(
            load_token_freq(lane.data), DRAFT_VOCAB, vocab_size, lane.vocab
        )


def draft_folder(work: Path, target: str, arm: str, seed: int) -> Path:
    return work / target / "runs" / f"{arm}-seed{seed}"


def train_one(work: Path, target_name: str, target: Path, arm: str, seed: int, args) -> Path:
    """The demo's draft training job with this arm's switches, seed and TTT depth."""
    from speculators_vllm016.demo.draft_training import train_config
    from speculators_vllm016.demo.options import DemoOptions
    from speculators_vllm016.train.jobs.job import run_train_job

    folder = draft_folder(work, target_name, arm, seed)
    last = folder / "checkpoints" / str(args.epochs - 1)
    if (last / "config.json").is_file():
        return last
    try:  # several `--stage train` processes may share the work: each draft goes to one
        folder.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        print(f"{folder}: trained or being trained by another process; skipped", flush=True)
        return last
    options = DemoOptions(epochs=args.epochs, lr=args.lr, seed=seed, show_progress=False)
    config = train_config(options, lane_of(work, target_name), target)
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, ttt_steps=TTT_STEPS, **ARMS[target_name][arm]),
        checkpoint=dataclasses.replace(config.checkpoint, save_path=str(folder / "checkpoints")),
        logging=dataclasses.replace(config.logging, log_dir=str(folder / "logs")),
    )
    run_train_job(config)
    return last


def arms_of(target: str, args: argparse.Namespace) -> list[str]:
    return [arm for arm in ARMS[target] if not args.arms or arm in args.arms]


def stage_train(work: Path, targets: dict[str, Path], args: argparse.Namespace) -> None:
    for name, target in targets.items():
        for seed in args.seeds:
            for arm in arms_of(name, args):
                print(name, arm, seed, train_one(work, name, target, arm, seed, args), flush=True)


def evaluate_target(work: Path, name: str, target: Path, k: int, args) -> list[dict]:
    """One hf-engine evaluation of every trained draft of `name` at k, each context length."""
    from speculators_vllm016.demo.held_out import HELD_OUT_FILE
    from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation

    contexts = "-".join(map(str, args.context_lengths))
    cache = work / name / f"eval-k{k}-p{args.eval_prompts}-n{args.max_new_tokens}-c{contexts}.json"
    runs = [(arm, seed) for seed in args.seeds for arm in arms_of(name, args)]
    if cache.is_file():
        rows = json.loads(cache.read_text())
        if {(r["arm"], r["seed"]) for r in rows} >= set(runs):
            return [r for r in rows if (r["arm"], r["seed"]) in set(runs)]
    report = run_evaluation(
        EvalOptions(
            drafts=[str(train_one(work, name, target, a, s, args)) for a, s in runs],
            data_path=str(work / "split" / HELD_OUT_FILE),
            verifier=str(target),
            max_prompts=args.eval_prompts,
            max_new_tokens=args.max_new_tokens,
            num_speculative_tokens=k,
            engine="hf",
            device="cpu",
            hf_cache_dir=str(work / "hf-cache"),
            show_progress=False,
            labels=[f"{a}-seed{s}" for a, s in runs],
            context_lengths=args.context_lengths,
        )
    )
    by_label = dict(zip([f"{a}-seed{s}" for a, s in runs], runs, strict=True))
    rows = [
        {
            "arm": by_label[d.label][0],
            "seed": by_label[d.label][1],
            "k": k,
            "context_length": d.context_length,
            "prompt_tokens": d.prompt_tokens,
            "tau": d.counts.acceptance_length,
            "per_position": d.counts.per_position_rates,
            "drafts": d.counts.num_drafts,
        }
        for d in report.drafts
    ]
    cache.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per (target, k, context, arm) tau over seeds; per comparison the per-seed differences."""
    cells: dict[tuple, dict[int, float]] = {}
    prompt_tokens: dict[tuple, float] = {}
    for r in rows:
        key = (r["target"], r["k"], r["context_length"])
        cells.setdefault((*key, r["arm"]), {})[r["seed"]] = r["tau"]
        prompt_tokens[key] = r["prompt_tokens"]
    arms = [
        {"target": t, "k": k, "context": c, "prompt_tokens": prompt_tokens[(t, k, c)], "arm": a,
         "seeds": len(v), **spread(list(v.values()))}
        for (t, k, c, a), v in sorted(cells.items())
    ]  # fmt: skip
    differences = []
    for target, arm, base in COMPARISONS:
        for t, k, c, a in sorted(cells):
            if (t, a) != (target, arm) or (t, k, c, base) not in cells:
                continue
            ours, theirs = cells[(t, k, c, a)], cells[(t, k, c, base)]
            diffs = [ours[s] - theirs[s] for s in sorted(ours) if s in theirs]
            differences.append(
                {"target": t, "k": k, "context": c, "comparison": f"{arm} - {base}",
                 "seeds": len(diffs), "wins": sum(d > 0 for d in diffs), **spread(diffs)}
            )  # fmt: skip
    return {"arms": arms, "differences": differences}


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"# Draft tau side by side on tiny targets ({result['date']}, CPU, hf engine)",
        "",
        f"Command: `{result['command']}` (stages data, train, eval). Seeds {s['seeds']}; "
        f"{s['epochs']} epochs of the demo's first {s['draft_rows']} draft rows (datagen "
        f"seq 512, float32), --ttt-steps {TTT_STEPS}, lr {s['lr']}, draft vocab {DRAFT_VOCAB}; "
        f"{result['prompts']} held-out questions, greedy, {s['max_new_tokens']} new tokens.",
        "",
        "| target | k | context asked (mean prompt tokens) | arm | tau median | min..max |",
        "|---|---:|---|---|---:|---|",
    ]
    for a in result["summary"]["arms"]:
        lines.append(
            f"| {a['target']} | {a['k']} | {a['context']} ({a['prompt_tokens']:.0f}) | "
            f"{a['arm']} | {a['median']:.3f} | {a['min']:.3f}..{a['max']:.3f} |"
        )
    lines += [
        "",
        "| target | k | context | difference | median | min..max | seeds ahead |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for d in result["summary"]["differences"]:
        lines.append(
            f"| {d['target']} | {d['k']} | {d['context']} | {d['comparison']} | "
            f"{d['median']:+.3f} | {d['min']:+.3f}..{d['max']:+.3f} | {d['wins']}/{d['seeds']} |"
        )
    return "\n".join(lines) + "\n"


def stage_eval(work: Path, targets: dict[str, Path], args: argparse.Namespace) -> None:
    from datetime import datetime, timezone

    rows = [
        {"target": name, **row}
        for name, target in targets.items()
        for k in args.ks
        for row in evaluate_target(work, name, target, k, args)
    ]
    held_out = (work / "split" / "held-out.jsonl").read_text().count("\n")
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": "python benchmarks/draft_tau.py " + " ".join(args.argv),
        "settings": {k: v for k, v in vars(args).items() if k not in ("work", "argv")},
        "prompts": min(held_out, args.eval_prompts),
        "rows": rows,
        "summary": summarize(rows),
    }
    print(markdown(result), flush=True)
    if args.output_stem:
        stem = Path(args.results_dir) / args.output_stem
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from speculators_vllm016.evaluate.context_prompts import parse_context_lengths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for targets, data, runs")
    parser.add_argument("--stage", choices=["targets", "data", "train", "eval"], required=True)
    parser.add_argument("--targets", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--arms", nargs="+", default=[], help="only these arms (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--draft-rows", type=int, default=128, help="demo rows the drafts train on")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 6], help="proposal lengths")
    parser.add_argument("--context-lengths", type=parse_context_lengths, default=[0, 1750])
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--output-stem", default=None, help="eval: results file name, no suffix")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    known = sorted({arm for arms in ARMS.values() for arm in arms})
    unknown = sorted(set(args.arms) - set(known))
    if unknown:
        parser.error(f"--arms {' '.join(unknown)}: the arms are {', '.join(known)}")
    if max(args.ks) > TTT_STEPS:
        parser.error(f"--ks goes up to the {TTT_STEPS} TTT steps the drafts are trained for")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a shared 2-core machine: OpenMP's spinning threads cost more
    from benchmarks.storage_dtype import build_targets

    args.work.mkdir(parents=True, exist_ok=True)
    built = build_targets(args.work / "targets", args.targets, deepseek_positions=2048)
    targets = {name: built[name] for name in args.targets}  # in the order asked
    stages = {"data": stage_data, "train": stage_train, "eval": stage_eval}
    if args.stage in stages:
        stages[args.stage](args.work, targets, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
