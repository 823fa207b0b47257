"""The demo's last stage: vLLM 0.16 serves the target with each trained draft (#45 item 4).

The held-out prompts the eval stage measured go through `LLM(speculative_config=...)` once per
trained draft and once without a draft. vLLM's own acceptance counters are printed beside the hf
engine's figures from the eval stage (greedy, fp32: they should be equal), the speculative
outputs are compared with the plain ones (lossless: all equal), and tokens/s with and without
speculation are reported. With `long_context` L (default 1,750 tokens), the same questions are
also served after earlier turns of the other held-out conversations until the prompt reaches
about L tokens (`evaluate.context_prompts`, as `speculators eval --context-lengths` builds them),
on the same engine: each draft's tau there and its ratio to the short prompts' tau say how much
acceptance the draft keeps as the context grows (#46). On vLLM's CPU build this runs through this
package's plugin (`vllm_plugin/cpu_speculation.py`); where vLLM cannot speculate here, the stage
says why and records nothing measured rather than failing the demo.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speculators_vllm016.demo.held_out import HELD_OUT_FILE

__all__ = ["WHAT_IT_SHOWS", "serve_stage", "serving_lines"]

WHAT_IT_SHOWS = (
    "what this shows: vLLM's own speculative decoding accepts what eval measured and changes no "
    "output; not speed: on a CPU with a tiny target the verifier costs about what the draft "
    "does and vLLM's spec-decode kernels run in Triton's interpreter, so tokens/s with "
    "speculation says nothing about a GPU"
)


def serve_stage(run: Any) -> tuple[dict, dict]:
    """Serve the held-out prompts with each trained draft and without; figures per draft.

    `run` is the demo's `stages.DemoRun` (not imported: `stages` imports this module)."""
    from transformers import AutoTokenizer

    from speculators_vllm016.evaluate.context_prompts import context_prompt_sets
    from speculators_vllm016.evaluate.prompts import load_eval_prompts
    from speculators_vllm016.evaluate.runner import draft_settings
    from speculators_vllm016.evaluate.vllm_engine import (
        VllmSettings,
        generate_sets_with_vllm,
        speculative_decoding_unavailable,
    )

    reason = speculative_decoding_unavailable()
    if reason is not None:
        return {}, {"skipped": reason}
    options = run.options
    tokenizer = AutoTokenizer.from_pretrained(str(run.target))
    held_out = str(run.split / HELD_OUT_FILE)
    cache = str(run.root / "hf-datasets-cache")
    short = load_eval_prompts(
        held_out, tokenizer, max_prompts=options.eval_prompts, cache_dir=cache
    )
    prompt_sets = [short.token_ids]
    if options.long_context:
        (long,) = context_prompt_sets(
            held_out, tokenizer, [options.long_context], short.rows, cache_dir=cache
        )
        prompt_sets.append(long.token_ids)
    settings = VllmSettings(dtype="float32", show_progress=options.show_progress)
    drafts = {"shipped": run.trained(run.shipped)}
    if options.regenerate:
        drafts["regenerated"] = run.trained(run.regenerated)
    plain = generate_sets_with_vllm(str(run.target), prompt_sets, options.max_new_tokens, settings)
    figures: dict = {
        "prompts": len(short.token_ids),
        "plain_tokens_per_second": plain[0].tokens_per_second,
    }
    if options.long_context:
        figures.update(_long_prompt_figures(options.long_context, prompt_sets[1]))
    for label, draft in drafts.items():
        k = draft_settings(str(draft)).speculative_tokens
        config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
        served = generate_sets_with_vllm(
            str(run.target), prompt_sets, options.max_new_tokens, settings, config
        )
        figures.update(_draft_figures(label, served, plain))
    eval_json = run.root / "eval" / "eval.json"
    figures["eval_tau"] = {
        row["label"]: row["acceptance_length"]
        for row in json.loads(Path(eval_json).read_text())["drafts"]
    }
    return {}, figures


def _long_prompt_figures(long_context: int, long_prompts: list[list[int]]) -> dict:
    """The long prompts asked for (`--long-context`) and their mean length in tokens as built
    (each question after whole earlier turns: at most the length asked for)."""
    return {
        "long_context": long_context,
        "long_prompt_tokens": sum(map(len, long_prompts)) / len(long_prompts),
    }


def _draft_figures(label: str, served: list, plain: list) -> dict:
    """One draft's figures: short prompts' tau, rates, tokens/s and outputs equal to plain
    greedy; with long prompts (a second set) their tau, equal outputs and tau long / short."""
    short = served[0]
    figures = {
        f"vllm_tau_{label}": short.counts.acceptance_length,
        f"vllm_rates_{label}": short.counts.per_position_rates,
        f"tokens_per_second_{label}": short.tokens_per_second,
        f"lossless_{label}": _equal_outputs(short, plain[0]),
    }
    if len(served) > 1:
        long = served[1]
        figures[f"vllm_tau_long_{label}"] = long.counts.acceptance_length
        figures[f"vllm_rates_long_{label}"] = long.counts.per_position_rates
        figures[f"lossless_long_{label}"] = _equal_outputs(long, plain[1])
        figures[f"long_over_short_{label}"] = (
            long.counts.acceptance_length / short.counts.acceptance_length
        )
    return figures


def _equal_outputs(served: Any, plain: Any) -> int:
    return sum(a == b for a, b in zip(served.outputs, plain.outputs, strict=True))


def serving_lines(figures: dict) -> list[str]:
    """The summary's lines for the serve stage's figures."""
    if "skipped" in figures:
        return [f"served by vLLM: skipped ({figures['skipped']})"]
    prompts = figures["prompts"]
    lines = [f"served by vLLM 0.16 (LLM(speculative_config=...), greedy, fp32, {prompts} prompts):"]
    for label, eval_tau in figures["eval_tau"].items():
        if f"vllm_tau_{label}" not in figures:
            continue
        rates = ", ".join(f"{rate:.3f}" for rate in figures[f"vllm_rates_{label}"])
        lines.append(
            f"  {label}: tau {figures[f'vllm_tau_{label}']:.4f} by vLLM's counters "
            f"(eval: {eval_tau:.4f}), per position {rates}; outputs equal to plain greedy on "
            f"{figures[f'lossless_{label}']}/{prompts}; "
            f"{figures[f'tokens_per_second_{label}']:.1f} tokens/s"
        )
        if f"vllm_tau_long_{label}" in figures:
            lines.append(
                f"    at ~{figures['long_prompt_tokens']:.0f}-token prompts (--long-context "
                f"{figures['long_context']}): tau {figures[f'vllm_tau_long_{label}']:.4f}, "
                f"long/short {figures[f'long_over_short_{label}']:.2f}; outputs equal to plain "
                f"greedy on {figures[f'lossless_long_{label}']}/{prompts}"
            )
    lines.append(f"  without speculation: {figures['plain_tokens_per_second']:.1f} tokens/s")
    lines.append(f"  {WHAT_IT_SHOWS}")
    return lines
