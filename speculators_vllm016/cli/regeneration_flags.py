"""The regeneration flags that `speculators regenerate` and `speculators datagen --regenerate`
share: sampling, chat template, reasoning, tool rows, prompt cap."""

from __future__ import annotations

import argparse

from speculators_vllm016.data_generation.regeneration.options import (
    REASONING_MODES,
    TOOL_ROW_MODES,
    SamplingOptions,
)

__all__ = ["add_regeneration_arguments", "sampling_from_args"]


def add_regeneration_arguments(
    group, seed_flag: str = "--seed", template_kwargs: bool = True
) -> None:
    """Sampling, template and limit flags (shared with `datagen --regenerate`, whose own
    `--seed` shuffles the data: there the sampling seed is `seed_flag="--regenerate-seed"`, and
    `--chat-template-kwargs` is a data flag of datagen's that both halves use:
    `template_kwargs=False`)."""
    group.add_argument(
        "--temperature", type=float, default=None, help="None: the model's generation config"
    )
    group.add_argument("--top-p", type=float, default=None, help="None: generation config")
    group.add_argument("--top-k", type=int, default=None, help="None: generation config")
    group.add_argument("--max-tokens", type=int, default=2048, help="at most this many per turn")
    group.add_argument(
        seed_flag,
        dest="regenerate_seed",
        type=int,
        default=0,
        help="sampling seed; each turn's own seed is drawn from (seed, row, turn)",
    )
    if template_kwargs:
        group.add_argument(
            "--chat-template-kwargs",
            default=None,
            help="JSON object for the chat template, e.g. '{\"thinking\": false}'",
        )
    group.add_argument(
        "--reasoning",
        choices=REASONING_MODES,
        default="keep",
        help="keep the thinking block in the turn as generated, or drop it (keep what follows)",
    )
    group.add_argument(
        "--tool-rows",
        choices=TOOL_ROW_MODES,
        default="skip",
        help="rows with tool calls: skip them (listed, counted) or keep them unchanged",
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=4096,
        help="a turn whose prompt is longer fails its row (listed with the reason)",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingOptions:
    return SamplingOptions(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.regenerate_seed,
    )
