"""Serve a target with its EAGLE-3 draft on vLLM 0.16 and measure what the draft buys.

Runs the same greedy generation in two fresh processes (so that GPU memory is returned):
(a) `LLM(target, speculative_config={"method": "eagle3", "model": draft, ...})` and (b) the target
alone. Each engine warms up (not timed), then generates the prompts `--repeats` times. Reports
vLLM's own spec-decode counters for (a) (acceptance rate per draft position and tau = 1 +
accepted / drafts, read as `speculators eval --engine vllm` reads them), generated tokens per
second of both (median and range over the repeats), the speed-up a/b of the medians, and how
many outputs are identical (greedy speculative decoding must not change them).

Prompts: `--data-path` takes a conversations file and renders each prompt as `speculators eval`
does (its tau is then comparable with eval's); else `--prompts-file` (one per line, sent as a
chat message) or 8 built-in prompts.

DeepSeek-V2/V3, Kimi-K2 and Kimi-K2.5 targets need this package's vLLM plugin (installed with
the package; `SPECULATORS_VLLM_PLUGIN=0` switches it off). On vLLM 0.16's CPU build the plugin
also lets vLLM speculate (`vllm_plugin/cpu_speculation.py`; engines start with
`enforce_eager=True` and datagen's CPU defaults): acceptance and identical outputs are real
there, tokens/s is not a GPU figure (spec-decode kernels run in Triton's interpreter).

    python benchmarks/serve_eagle3.py --target moonshotai/Kimi-K2.5 --draft ./kimi-draft \\
        --tensor-parallel-size 8 --trust-remote-code --num-prompts 64 --max-new-tokens 256 \\
        --json benchmarks/results/serve-kimi.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "Explain how a hash map handles collisions, with a short Python example.",
    "Write a haiku about the first snow in a city.",
    "What is the difference between TCP and UDP? Answer in five bullet points.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Solve step by step: a train leaves at 9:40 and arrives at 13:05. How long is the trip?",
    "Translate into French: 'The library opens at nine and closes at six.'",
    "Give three tips for writing readable unit tests.",
    "Describe photosynthesis to a ten-year-old.",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="serve_eagle3.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--target", required=True, help="target model folder or hub id")
    parser.add_argument(
        "--draft",
        required=True,
        type=Path,
        action="append",
        help="EAGLE-3 draft folder (ours or 0.3.0's); repeat to serve several, one engine each",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=3, help="draft tokens per step"
    )
    parser.add_argument(
        "--prompts-file", type=Path, help="one prompt per line (default: 8 built-in prompts)"
    )
    parser.add_argument(
        "--data-path",
        type=Path,
        help="conversations (.jsonl) whose prompts are rendered as `speculators eval` renders them",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=32, help="prompts used, cycling the list"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed generations of the prompts per engine"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="Kimi's tokenizer needs it"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the run without speculation"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--mode", choices=["speculative", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--draft-index", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    """The first user mistake, as one line; None when the arguments can run."""
    for draft in args.draft:
        if not (draft / "config.json").is_file():
            return f"--draft {draft} has no config.json: give the draft folder training saved"
    if args.num_speculative_tokens < 1:
        return f"--num-speculative-tokens must be at least 1, got {args.num_speculative_tokens}"
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        return "--num-prompts, --max-new-tokens and --repeats must be at least 1"
    if args.data_path is not None and args.prompts_file is not None:
        return "give --data-path or --prompts-file, not both"
    if args.data_path is not None and not args.data_path.is_file():
        return f"--data-path {args.data_path} does not exist"
    if args.prompts_file is not None and not args.prompts_file.is_file():
        return f"--prompts-file {args.prompts_file} does not exist"
    if args.prompts_file is not None and not load_prompts(args.prompts_file, 1):
        return f"--prompts-file {args.prompts_file} holds no prompt"
    return None


def load_prompts(path: Path | None, count: int) -> list[str]:
    lines = (
        DEFAULT_PROMPTS
        if path is None
        else [ln for ln in path.read_text().splitlines() if ln.strip()]
    )
    return [lines[i % len(lines)] for i in range(count)] if lines else []


def _requests(args: argparse.Namespace, llm: Any) -> tuple[list[Any], bool]:
    """The prompts as vLLM requests, and whether they are token ids (else chat messages)."""
    if args.data_path is None:
        prompts = load_prompts(args.prompts_file, args.num_prompts)
        return [[{"role": "user", "content": p}] for p in prompts], False
    from vllm.inputs import TokensPrompt

    from speculators_vllm016.evaluate.prompts import load_eval_prompts

    prompts = load_eval_prompts(str(args.data_path), llm.get_tokenizer(), args.num_prompts)
    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts.token_ids], True


def _engine(args: argparse.Namespace, speculative: bool) -> Any:
    import contextlib

    from vllm import LLM

    from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES
    from speculators_vllm016.evaluate.vllm_engine import on_cpu_build

    cpu = on_cpu_build()
    defaults: Any = contextlib.nullcontext()
    if cpu:
        from speculators_vllm016.data_generation.cpu_defaults import cpu_defaults_applied
        from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

        config = load_verifier_config_dict(args.target)
        defaults = cpu_defaults_applied(args.tensor_parallel_size, config)
    k = args.num_speculative_tokens
    with defaults:
        return LLM(
            model=args.target,
            tensor_parallel_size=args.tensor_parallel_size,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            trust_remote_code=args.trust_remote_code,
            disable_log_stats=False,
            seed=0,
            enforce_eager=cpu,
            limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),  # Kimi-K2.5: text only
            speculative_config=(
                {
                    "method": "eagle3",
                    "model": str(args.draft[args.draft_index]),
                    "num_speculative_tokens": k,
                }
                if speculative
                else None
            ),
        )


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    """One engine, in this process: warm up, then time greedy generation `--repeats` times."""
    from vllm import SamplingParams

    from speculators_vllm016.evaluate.vllm_engine import counts_difference, counts_from_metrics

    speculative = args.mode == "speculative"
    k = args.num_speculative_tokens
    llm = _engine(args, speculative)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    requests, token_ids = _requests(args, llm)
    generate = llm.generate if token_ids else llm.chat
    generate(requests[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    seconds, counts, outputs = [], [], []
    for _ in range(args.repeats):
        before = counts_from_metrics(llm.get_metrics(), k)
        start = time.perf_counter()
        results = generate(requests, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        counts.append(counts_difference(counts_from_metrics(llm.get_metrics(), k), before))
        outputs.append([list(r.outputs[0].token_ids) for r in results])
    if any(o != outputs[0] for o in outputs):
        raise SystemExit(f"the {args.mode} run's greedy outputs differ between repeats")
    first = counts[0]
    return {
        "mode": args.mode,
        "seconds": seconds,
        "generated_tokens": sum(len(o) for o in outputs[0]),
        "outputs": outputs[0],
        "num_drafts": first.num_drafts if speculative else 0,
        "per_position": first.per_position_rates if speculative else [],
        "tau": first.acceptance_length if speculative else None,
        "tau_per_repeat": [c.acceptance_length for c in counts] if speculative else [],
    }


def _rates(run: dict[str, Any]) -> tuple[float, float, float]:
    """Median, lowest and highest tokens/s over the repeats."""
    import statistics

    rates = [run["generated_tokens"] / s for s in run["seconds"]]
    return statistics.median(rates), min(rates), max(rates)


def report(speculative: dict[str, Any], baseline: dict[str, Any] | None) -> list[str]:
    """The printed summary of one or both runs."""
    spec_rate, spec_low, spec_high = _rates(speculative)
    repeats = len(speculative["seconds"])
    lines = [
        f"EAGLE-3: {speculative['num_drafts']} drafts, tau {speculative['tau']:.4f}",
        "acceptance per position: "
        + ", ".join(f"{i + 1}: {rate:.3f}" for i, rate in enumerate(speculative["per_position"])),
        f"with draft: {speculative['generated_tokens']} tokens, median {spec_rate:.1f} tokens/s "
        f"(range {spec_low:.1f}-{spec_high:.1f}, {repeats} repeats)",
    ]
    if baseline is not None:
        base_rate, base_low, base_high = _rates(baseline)
        same = sum(a == b for a, b in zip(speculative["outputs"], baseline["outputs"]))
        lines += [
            f"without:    {baseline['generated_tokens']} tokens, median {base_rate:.1f} tokens/s "
            f"(range {base_low:.1f}-{base_high:.1f}, {len(baseline['seconds'])} repeats)",
            f"speed-up {spec_rate / base_rate:.2f}x (medians); identical outputs "
            f"{same}/{len(baseline['outputs'])}",
        ]
    return lines


def _child(argv: list[str], mode: str, folder: Path, index: int = 0) -> dict[str, Any]:
    result_file = folder / f"{mode}-{index}.json"
    command = [sys.executable, __file__, *argv, "--mode", mode, "--result-file", str(result_file)]
    command += ["--draft-index", str(index)]
    done = subprocess.run(command, check=False)
    if done.returncode != 0 or not result_file.is_file():
        raise SystemExit(f"the {mode} run failed (exit {done.returncode}); its log is above")
    return json.loads(result_file.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.mode is not None:  # a child: one engine, result to the file
        args.result_file.write_text(json.dumps(run_mode(args)))
        return 0
    from speculators_vllm016.evaluate.vllm_engine import speculative_decoding_unavailable

    reason = speculative_decoding_unavailable()
    if reason is not None:
        print(
            f"error: {reason}; this benchmark needs vLLM 0.16 that can speculate", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="serve_eagle3_") as folder:
        runs = [
            {"draft": str(draft), "speculative": _child(argv, "speculative", Path(folder), index)}
            for index, draft in enumerate(args.draft)
        ]
        baseline = None if args.no_baseline else _child(argv, "baseline", Path(folder))
    lines = []
    for run in runs:
        lines += [f"draft {run['draft']}:", *report(run["speculative"], baseline)]
    print("\n".join(lines))
    if args.json is not None:
        settings = {
            k: [str(d) for d in v] if k == "draft" else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "settings": settings,
                    "runs": runs,
                    "baseline": baseline,
                    "report": lines,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
