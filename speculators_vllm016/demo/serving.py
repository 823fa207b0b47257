"""The demo's last stage: vLLM 0.16 serves the target with each trained draft (#45 item 4).

The held-out prompts the eval stage measured go through `LLM(speculative_config=...)` once per
trained draft and once without a draft. vLLM's own acceptance counters are printed beside the hf
engine's figures from the eval stage (greedy, fp32: they should be equal), the speculative
outputs are compared with the plain ones (lossless: all equal), and tokens/s with and without
speculation are reported. On vLLM's CPU build this runs through this package's plugin
(`vllm_plugin/cpu_speculation.py`); where vLLM cannot speculate here, the stage says why and
records nothing measured rather than failing the demo.
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

    from speculators_vllm016.evaluate.prompts import load_eval_prompts
    from speculators_vllm016.evaluate.runner import draft_settings
    from speculators_vllm016.evaluate.vllm_engine import (
        VllmSettings,
        generate_with_vllm,
        speculative_decoding_unavailable,
    )

    reason = speculative_decoding_unavailable()
    if reason is not None:
        return {}, {"skipped": reason}
    options = run.options
    tokenizer = AutoTokenizer.from_pretrained(str(run.target))
    prompts = load_eval_prompts(
        str(run.split / HELD_OUT_FILE),
        tokenizer,
        max_prompts=options.eval_prompts,
        cache_dir=str(run.root / "hf-datasets-cache"),
    ).token_ids
    settings = VllmSettings(dtype="float32", show_progress=options.show_progress)
    drafts = {"shipped": run.trained(run.shipped)}
    if options.regenerate:
        drafts["regenerated"] = run.trained(run.regenerated)
    plain = generate_with_vllm(str(run.target), prompts, options.max_new_tokens, settings)
    figures: dict = {"prompts": len(prompts), "plain_tokens_per_second": plain.tokens_per_second}
    for label, draft in drafts.items():
        k = draft_settings(str(draft)).speculative_tokens
        config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
        served = generate_with_vllm(
            str(run.target), prompts, options.max_new_tokens, settings, config
        )
        figures[f"vllm_tau_{label}"] = served.counts.acceptance_length
        figures[f"vllm_rates_{label}"] = served.counts.per_position_rates
        figures[f"tokens_per_second_{label}"] = served.tokens_per_second
        figures[f"lossless_{label}"] = sum(
            a == b for a, b in zip(served.outputs, plain.outputs, strict=True)
        )
    eval_json = run.root / "eval" / "eval.json"
    figures["eval_tau"] = {
        row["label"]: row["acceptance_length"]
        for row in json.loads(Path(eval_json).read_text())["drafts"]
    }
    return {}, figures


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
    lines.append(f"  without speculation: {figures['plain_tokens_per_second']:.1f} tokens/s")
    lines.append(f"  {WHAT_IT_SHOWS}")
    return lines
