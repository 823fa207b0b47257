"""Acceptance (tau) against context length for the long-context options, on a tiny target (#46).

A draft trained on rows of N tokens is measured on prompts of N and of 4N tokens (and any
`--multiples`): full attention against `--sliding-window W` (the option meant to keep acceptance
past the trained length), same data, same steps, same seeds. The target is the taught tiny
DeepSeek-V3 of the tests (tests/tiny_models.py: 7 layers, trained on the demo conversations in
rows of 64 tokens, so prompts up to 64 tokens are lengths it was trained at); its hidden states
at datagen's default layers [2, 3, 4, 6] are captured with transformers for rows of N tokens cut
from the token stream of the first 200 demo conversations. The prompts are `--prompts` windows of
the stream of the last 70 conversations (never trained on), each the last L tokens before the
same point, so every length asks for the same continuation; greedy, k = 3, `--new-tokens`
tokens, `eval --engine hf`'s speculative decoding (`speculative_generate`). Median and range
over seeds of tau at each length and of tau(longest) / tau(N).

    python benchmarks/long_context_tau.py --work /tmp/long-tau --row-tokens 16 --seeds 0 1 \
        --windows full 16 --output benchmarks/results/long-context-tau-tiny-deepseek-v3.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYER_IDS = [2, 3, 4, 6]  # datagen's default for 7 layers
DRAFT_VOCAB = 256
TRAIN_CONVERSATIONS = 200
HELD_OUT_FROM = 250


def _streams(tokenizer) -> tuple[list[int], list[int]]:
    """Token streams of the training conversations and of the held-out ones."""
    from speculators_vllm016.demo import demo_conversations_path, read_conversations

    conversations = list(read_conversations(demo_conversations_path()))

    def stream(rows: list) -> list[int]:
        ids: list[int] = []
        for messages in rows:
            ids += tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
        return ids

    return stream(conversations[:TRAIN_CONVERSATIONS]), stream(conversations[HELD_OUT_FROM:])


def prepare(work: Path, row_tokens: int, rows: int) -> tuple[Path, Path, list[int]]:
    """The taught target, `rows` sample files of `row_tokens` tokens each, the held-out stream."""
    from tests.tiny_models import build_taught_tiny_deepseek_v3

    target = build_taught_tiny_deepseek_v3(work / "target")
    data = work / f"data-{row_tokens}x{rows}"
    return target, data, write_rows(target, data, row_tokens, rows)


def write_rows(target: Path, data: Path, row_tokens: int, rows: int) -> list[int]:
    """`rows` sample files of `row_tokens` tokens of the training stream with the target's hidden
    states (transformers, fp32) and vocabulary maps in `data`; returns the held-out stream."""
    from transformers import AutoTokenizer

    from speculators_vllm016.data_generation.sample_io import write_sample
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tests.hf_reference import HFReference

    stream, held_out = _streams(AutoTokenizer.from_pretrained(str(target)))
    if rows * row_tokens > len(stream):
        raise SystemExit(f"--rows {rows} of {row_tokens} tokens: the stream has {len(stream)}")
    if (data / "data_config.json").exists():
        return held_out
    data.mkdir(parents=True, exist_ok=True)
    reference = HFReference(target)
    counts: dict[int, int] = {}
    for index in range(rows):
        ids = stream[index * row_tokens : (index + 1) * row_tokens]
        sample = {
            "input_ids": torch.tensor(ids),
            "hidden_states": reference.streams(ids, LAYER_IDS),
            "loss_mask": torch.ones(len(ids), dtype=torch.long),
        }
        write_sample(data / f"data_{index}.pt", sample, output_format="pt")
        for token in ids:
            counts[token] = counts.get(token, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(counts, DRAFT_VOCAB, 512)
    np.save(data / "d2t.npy", d2t.numpy())
    np.save(data / "t2d.npy", t2d.numpy())
    (data / "data_config.json").write_text(json.dumps({"hidden_states": {"layer_ids": LAYER_IDS}}))
    return held_out


def train(target: Path, data: Path, save: Path, window: str, seed: int, epochs: int) -> Path:
    from speculators_vllm016.cli.train import main

    args = [
        "--verifier-name-or-path", str(target), "--data-path", str(data),
        "--save-path", str(save), "--d2t-path", str(data / "d2t.npy"),
        "--t2d-path", str(data / "t2d.npy"), "--total-seq-len", "128",
        "--epochs", str(epochs), "--lr", "3e-3", "--num-workers", "0", "--no-progress",
        "--seed", str(seed), "--log-dir", str(save.parent / f"logs-{save.name}"),
    ]  # fmt: skip
    if window != "full":
        args += ["--sliding-window", window]
    if not (save / str(epochs - 1) / "config.json").exists() and main(args) != 0:
        raise SystemExit(f"training window {window} seed {seed} failed")
    return save / str(epochs - 1)


def taus(
    target: Path,
    draft_folder: Path,
    held_out: list[int],
    lengths: list[int],
    prompts: int = 24,
    stride: int = 97,
    new_tokens: int = 16,
) -> dict[int, float]:
    """tau at each prompt length: the same continuation points, the last L tokens before each."""
    from speculators_vllm016.evaluate.speculative import speculative_generate
    from speculators_vllm016.model import SpeculatorModel
    from speculators_vllm016.models.verifier_lm import load_verifier_lm

    verifier = load_verifier_lm(str(target), torch.float32, False).eval()
    draft = SpeculatorModel.from_pretrained(str(draft_folder), verifier_attachment_mode="detached")
    draft = draft.float().eval()
    draft.load_verifier_weights(str(target))
    longest = max(lengths)
    points = [longest + i * stride for i in range(prompts)]
    if points[-1] > len(held_out):
        raise SystemExit("the held-out stream is too short for these prompts; lower --prompts")
    result = {}
    for length in lengths:
        asked = [held_out[point - length : point] for point in points]
        generated = speculative_generate(verifier, draft, asked, new_tokens, 3, eos_token_ids=[])
        result[length] = generated.counts.acceptance_length
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for target, data, runs")
    parser.add_argument("--row-tokens", type=int, default=16, help="N: tokens per training row")
    parser.add_argument("--rows", type=int, default=300, help="training rows")
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 4], help="prompt = mN")
    parser.add_argument("--windows", nargs="+", default=["full", "16"], help="full or W")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--stride", type=int, default=97, help="tokens between prompt points")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--output", type=Path, default=None, help="JSON of every run + summary")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    target, data, held_out = prepare(args.work, args.row_tokens, args.rows)
    lengths = [m * args.row_tokens for m in args.multiples]
    runs = []
    for seed in args.seeds:
        for window in args.windows:
            save = args.work / f"draft-{args.row_tokens}x{args.rows}-{window}-{seed}"
            folder = train(target, data, save, window, seed, args.epochs)
            measured = taus(
                target, folder, held_out, lengths, args.prompts, args.stride, args.new_tokens
            )
            runs.append({"window": window, "seed": seed, "tau": measured})
            print(json.dumps(runs[-1]), flush=True)
            _write(args, lengths, runs, time.perf_counter() - started)
    return 0


def _write(args: argparse.Namespace, lengths: list[int], runs: list[dict], seconds: float) -> None:
    """Every run so far, medians and ranges over seeds (rewritten after each run)."""
    summary: dict = {}
    for window in args.windows:
        done = [run for run in runs if run["window"] == window]
        if not done:
            continue
        summary[window] = {}
        for length in lengths:
            values = [run["tau"][length] for run in done]
            summary[window][f"tau_at_{length}"] = _spread(values)
        kept = [run["tau"][max(lengths)] / run["tau"][min(lengths)] for run in done]
        summary[window]["long_over_short"] = _spread(kept)
    report = {
        "settings": {**vars(args), "work": str(args.work), "output": str(args.output)},
        "lengths": lengths,
        "runs": runs,
        "summary": summary,
        "seconds": seconds,
    }
    print(json.dumps(summary), flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    raise SystemExit(main())
