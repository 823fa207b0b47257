"""The regeneration flags that `speculators regenerate`, `speculators datagen --regenerate` and
`speculators gen-and-train --regenerate` share: sampling, chat template, reasoning, tool rows,
prompt cap; the prompt and response limits fitted to the model's context; and the check that
the flags are given only where they are used."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from speculators_vllm016.cli.field_flags import FlagView, add_option_flags, option_field_specs
from speculators_vllm016.data_generation.regeneration.options import (
    REASONING_MODES,
    TOOL_ROW_MODES,
    SamplingOptions,
)
from speculators_vllm016.utils.errors import InvalidInputError

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 2048
DEFAULT_MAX_PROMPT_TOKENS = 4096

__all__ = [
    "DEFAULT_MAX_PROMPT_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "OnePassFlags",
    "RegenerationFlags",
    "add_regeneration_arguments",
    "regeneration_view",
    "fit_lengths_to_model",
    "refuse_misplaced_regeneration_flags",
    "sampling_from_args",
]


@dataclass
class RegenerationFlags:
    """The regeneration flags of `speculators regenerate`, `datagen --regenerate` and
    `gen-and-train --regenerate`: each declared once, here (its docstring is its help). The
    lengths left None are fitted to the model's context (`fit_lengths_to_model`) before they
    become `RegenerateOptions`."""

    temperature: float | None = None
    """None: the model's generation config."""
    top_p: float | None = None
    """None: generation config."""
    top_k: int | None = None
    """None: generation config."""
    max_tokens: int | None = None
    """At most this many per turn; None: 2048, lowered to fit the model's context."""
    regenerate_seed: int = 0
    """Sampling seed; each turn's own seed is drawn from (seed, row, turn)."""
    chat_template_kwargs: str | None = None
    """JSON object for the chat template, e.g. '{"thinking": false}'."""
    reasoning: str = field(default="keep", metadata={"choices": REASONING_MODES})
    """Keep the thinking block in the turn as generated, or drop it (keep what follows)."""
    tool_rows: str = field(default="skip", metadata={"choices": TOOL_ROW_MODES})
    """Rows with tool calls: skip them (listed, counted) or keep them unchanged."""
    max_prompt_tokens: int | None = None
    """A turn whose prompt is longer fails its row (listed with the reason); None: 4096, lowered
    to fit the model's context with --max-tokens."""


@dataclass
class OnePassFlags:
    """`datagen --regenerate`'s own flags: regenerate, then extract, with one engine load."""

    regenerate: bool = False
    """First replace every assistant turn by the target's own response (as `speculators
    regenerate` does), then extract the regenerated conversations."""
    regenerate_dir: str | None = None
    """Folder of the regenerated conversations; None: <output-dir>/regenerated."""


def regeneration_view(seed_flag: str = "--seed", template_kwargs: bool = True) -> FlagView:
    """How a command shows `RegenerationFlags`: `speculators regenerate` names the sampling seed
    `--seed`; datagen, whose own `--seed` shuffles the data, `--regenerate-seed`, and its
    `--chat-template-kwargs` is a data flag both halves use (`template_kwargs=False`)."""
    names = [spec.name for spec in option_field_specs(RegenerationFlags)]
    if not template_kwargs:
        names.remove("chat_template_kwargs")
    flags = {} if seed_flag == "--regenerate-seed" else {"regenerate_seed": seed_flag}
    return FlagView(names=tuple(names), flags=flags)


def add_regeneration_arguments(
    group, seed_flag: str = "--seed", template_kwargs: bool = True
) -> None:
    """The `RegenerationFlags` as flags of `group`, as `regeneration_view` shows them."""
    add_option_flags(group, RegenerationFlags, regeneration_view(seed_flag, template_kwargs))


def _model_context(args: argparse.Namespace) -> tuple[int | None, dict | None]:
    """The engine's longest context: --max-model-len where given, else the model's own (None
    where it stretches it by RoPE scaling or cannot be read here: the engine's start says);
    and the target's config.json where it was read for it."""
    if getattr(args, "max_model_len", None) is not None:
        return int(args.max_model_len), None
    try:
        from transformers import PretrainedConfig

        from speculators_vllm016.utils.text_config import text_config_of

        config, _ = PretrainedConfig.get_config_dict(
            args.target_model_path, trust_remote_code=getattr(args, "trust_remote_code", False)
        )
    except Exception:  # noqa: BLE001 - an unreadable model is reported where it is loaded
        return None, None
    text = text_config_of(config)
    limit = text.get("max_position_embeddings")
    return (limit if isinstance(limit, int) and not text.get("rope_scaling") else None), config


def fit_lengths_to_model(args: argparse.Namespace) -> dict | None:
    """Set `args.max_prompt_tokens` and `args.max_tokens`: the values given, and for each left
    unset its default, lowered (one log line says so) where the two together would not fit the
    model's context: --max-tokens given, the prompt gets the rest; --max-prompt-tokens given, the
    response does; neither, the response gets half the context (at most its default) and the
    prompt the rest. Values given that do not fit are left for the one-line refusal.

    Returns the target's config.json where it was read here (for the engine's start, which then
    reads it no more: `RegenerateOptions.target_config`); None where it was not."""
    prompt, tokens = args.max_prompt_tokens, args.max_tokens
    if prompt is not None and tokens is not None:
        return None
    fitted_prompt = DEFAULT_MAX_PROMPT_TOKENS if prompt is None else prompt
    fitted_tokens = DEFAULT_MAX_TOKENS if tokens is None else tokens
    context, config = _model_context(args)
    if context is not None and fitted_prompt + fitted_tokens > context:
        if prompt is None and tokens is None:
            fitted_tokens = min(DEFAULT_MAX_TOKENS, context // 2)
            fitted_prompt = context - fitted_tokens
        elif prompt is None:
            fitted_prompt = context - tokens
        else:
            fitted_tokens = context - prompt
        if fitted_prompt >= 1 and fitted_tokens >= 1:
            lowered = [
                f"{flag} {value}"
                for flag, value, given in (
                    ("--max-prompt-tokens", fitted_prompt, prompt),
                    ("--max-tokens", fitted_tokens, tokens),
                )
                if given is None
            ]
            logger.info(
                "%s: lowered from the default to fit the engine context of %d tokens",
                " and ".join(lowered),
                context,
            )
        else:  # what was given leaves no room: the refusal names it
            fitted_prompt = DEFAULT_MAX_PROMPT_TOKENS if prompt is None else prompt
            fitted_tokens = DEFAULT_MAX_TOKENS if tokens is None else tokens
    args.max_prompt_tokens, args.max_tokens = fitted_prompt, fitted_tokens
    return config


def sampling_from_args(args: argparse.Namespace) -> SamplingOptions:
    fit_lengths_to_model(args)
    return SamplingOptions(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.regenerate_seed,
    )


def refuse_misplaced_regeneration_flags(
    args: argparse.Namespace,
    seed_flag: str = "--seed",
    extra: dict[str, str] | None = None,
    allow_shards: bool = False,
) -> None:
    """A regeneration flag without `--regenerate` would be ignored, and `--regenerate` on Ray
    (or with shards where the command runs them all, `allow_shards` False: gen-and-train) would
    not regenerate: refused in one line.

    `extra` names the command's own regeneration flags beyond the shared ones ({dest: flag}),
    each unset (None) unless `--regenerate` is given.
    """
    if args.regenerate:
        if getattr(args, "ray_address", None) is not None:
            raise InvalidInputError(
                "--regenerate does not run on Ray (--ray-address); start one datagen --regenerate "
                "per shard, all at once, with --num-shards N --shard-index I"
            )
        if not allow_shards and getattr(args, "num_shards", 1) > 1:
            raise InvalidInputError(
                "gen-and-train --regenerate runs unsharded; for shards, start `speculators "
                "datagen --regenerate --num-shards N --shard-index I` per machine, all at once, "
                "then `vocab-mapping` and `train` on the folder"
            )
        return
    shared = argparse.ArgumentParser(add_help=False)
    # --chat-template-kwargs is datagen's own data flag (both halves use it), not one of these.
    add_regeneration_arguments(shared, seed_flag=seed_flag, template_kwargs=False)
    defaults = {
        action.dest: (action.option_strings[0], action.default) for action in shared._actions
    }
    defaults.update({dest: (flag, None) for dest, flag in (extra or {}).items()})
    given = [flag for dest, (flag, default) in defaults.items() if getattr(args, dest) != default]
    if given:
        what = "a regeneration flag" if len(given) == 1 else "regeneration flags"
        them = "it" if len(given) == 1 else "them"
        raise InvalidInputError(
            f"{', '.join(given)}: {what}, used only with --regenerate; add --regenerate or "
            f"leave {them} out"
        )
