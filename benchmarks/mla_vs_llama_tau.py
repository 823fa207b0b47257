"""Acceptance length (tau) of the MLA draft vs the Llama-layer draft on the tiny DeepSeek-V3.

Same data, same steps, same seeds for both: the taught tiny DeepSeek-V3 (tests/tiny_models.py,
trained on the demo conversations, 7 layers), its hidden states of the demo conversations
captured with transformers at datagen's default layers [2, 3, 4, 6] (what the engine tests show
datagen writes), every fifth conversation held out. Each (arch, seed) trains a draft with
`speculators train --draft-arch ARCH --seed SEED` for `--epochs`, then `eval --engine hf`'s greedy
speculative decoding (`speculative_generate`) measures tau at k = `--k` on the held-out
conversations' first `--prompt-tokens` tokens. Medians and ranges over seeds, side by side.

    python benchmarks/mla_vs_llama_tau.py --work /tmp/mla-tau --seeds 0 1 2 --epochs 3 \
        --output benchmarks/results/mla-vs-llama-tau-tiny-deepseek-v3.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYER_IDS = [2, 3, 4, 6]  # datagen's default for 7 layers
DRAFT_VOCAB = 256


def _conversation_ids(tokenizer) -> list[list[int]]:
    from speculators_vllm016.demo import demo_conversations_path, read_conversations

    rows = []
    for messages in read_conversations(demo_conversations_path()):
        text = "\n".join(m["content"] for m in messages)
        rows.append(tokenizer(text)["input_ids"][:240])
    return rows


def prepare(work: Path, train_rows_limit: int) -> tuple[Path, Path, list[list[int]]]:
    """The taught target, sample files of (the first `train_rows_limit`) training conversations,
    the held-out rows."""
    from transformers import AutoTokenizer

    from speculators_vllm016.data_generation.sample_io import write_sample
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tests.hf_reference import HFReference
    from tests.tiny_models import build_taught_tiny_deepseek_v3

    target = build_taught_tiny_deepseek_v3(work / "target")
    rows = _conversation_ids(AutoTokenizer.from_pretrained(str(target)))
    held_out = [row for i, row in enumerate(rows) if i % 5 == 0]
    train_rows = [row for i, row in enumerate(rows) if i % 5 != 0][:train_rows_limit]
    data = work / f"data-{len(train_rows)}"
    if not (data / "data_config.json").exists():
        data.mkdir(parents=True, exist_ok=True)
        reference = HFReference(target)
        counts: dict[int, int] = {}
        for index, ids in enumerate(train_rows):
            states = reference.streams(ids, LAYER_IDS)
            sample = {
                "input_ids": torch.tensor(ids),
                "hidden_states": states,
                "loss_mask": torch.ones(len(ids), dtype=torch.long),
            }
            write_sample(data / f"data_{index}.pt", sample, output_format="pt")
            for token in ids:
                counts[token] = counts.get(token, 0) + 1
        d2t, t2d = build_vocab_mappings_from_distribution(counts, DRAFT_VOCAB, 512)
        np.save(data.parent / f"{data.name}-d2t.npy", d2t.numpy())
        np.save(data.parent / f"{data.name}-t2d.npy", t2d.numpy())
        (data / "data_config.json").write_text(
            json.dumps({"hidden_states": {"layer_ids": LAYER_IDS}})
        )
    return target, data, held_out


def train(target: Path, data: Path, save: Path, arch: str, seed: int, epochs: int) -> Path:
    from speculators_vllm016.cli.train import main

    args = [
        "--verifier-name-or-path", str(target), "--data-path", str(data),
        "--save-path", str(save), "--d2t-path", str(data.parent / f"{data.name}-d2t.npy"),
        "--t2d-path", str(data.parent / f"{data.name}-t2d.npy"), "--total-seq-len", "512",
        "--epochs", str(epochs), "--lr", "3e-3", "--num-workers", "0", "--no-progress",
        "--seed", str(seed), "--draft-arch", arch, "--log-dir", str(save.parent / f"logs-{save.name}"),
    ]  # fmt: skip
    if main(args) != 0:
        raise SystemExit(f"training {arch} seed {seed} failed")
    return save / str(epochs - 1)


def tau(target: Path, draft_folder: Path, prompts: list[list[int]], k: int, tokens: int) -> float:
    from speculators_vllm016.evaluate.speculative import speculative_generate
    from speculators_vllm016.model import SpeculatorModel
    from speculators_vllm016.models.verifier_lm import load_verifier_lm

    verifier = load_verifier_lm(str(target), torch.float32, False).eval()
    draft = SpeculatorModel.from_pretrained(str(draft_folder), verifier_attachment_mode="detached")
    draft = draft.float().eval()
    draft.load_verifier_weights(str(target))
    result = speculative_generate(verifier, draft, prompts, tokens, k, eos_token_ids=[])
    return result.counts.acceptance_length


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for target, data, runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-rows", type=int, default=10**9, help="training conversations")
    parser.add_argument("--k", type=int, default=3, help="speculative tokens at eval")
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=None, help="JSON of every run + summary")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, data, held_out = prepare(args.work, args.train_rows)
    prompts = [row[: args.prompt_tokens] for row in held_out if len(row) > args.prompt_tokens]
    runs = []
    for seed in args.seeds:
        for arch in ("llama", "mla"):
            folder = train(target, data, args.work / f"{arch}-{seed}", arch, seed, args.epochs)
            value = tau(target, folder, prompts, args.k, args.new_tokens)
            runs.append({"arch": arch, "seed": seed, "tau": value})
            print(json.dumps(runs[-1]), flush=True)
            _write(args, prompts, runs)
    _write(args, prompts, runs)
    return 0


def _write(args: argparse.Namespace, prompts: list[list[int]], runs: list[dict]) -> None:
    """Every run so far and the medians and ranges over seeds (rewritten after each run)."""
    summary = {}
    for arch in ("llama", "mla"):
        values = [run["tau"] for run in runs if run["arch"] == arch]
        if not values:
            continue
        summary[arch] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    report = {
        "settings": {**vars(args), "work": str(args.work), "output": str(args.output)},
        "prompts": len(prompts),
        "runs": runs,
        "summary": summary,
    }
    print(json.dumps(summary), flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
