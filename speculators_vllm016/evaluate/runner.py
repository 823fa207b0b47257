"""`speculators eval` as a library call: load prompts once, measure each draft, collect a report."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.evaluate.context_prompts import ContextPrompts
from speculators_vllm016.evaluate.generation import GenerationResult
from speculators_vllm016.evaluate.report import DraftEvaluation, EvaluationReport
from speculators_vllm016.evaluate.training_metrics import find_training_estimate
from speculators_vllm016.evaluate.verifier_match import (
    VerifierShape,
    check_verifier_matches,
    expected_verifier,
)
from speculators_vllm016.utils.errors import InvalidInputError, first_line

if TYPE_CHECKING:
    from speculators_vllm016.evaluate.prompts import EvalPrompts

__all__ = [
    "ENGINES",
    "EvalOptions",
    "draft_settings",
    "named_verifier",
    "resolve_engine",
    "run_evaluation",
]

logger = logging.getLogger(__name__)

ENGINES = ("auto", "hf", "vllm")


@dataclass
class EvalOptions:
    drafts: list[str]
    data_path: str
    verifier: str | None = None  # default: the drafts' config names it
    max_prompts: int | None = 100
    max_new_tokens: int = 128
    num_speculative_tokens: int | None = None  # default: each draft's config
    engine: str = "auto"
    tensor_parallel_size: int = 1  # vllm engine: GPUs per verifier copy
    batch_size: int = 8
    device: str | None = None  # hf engine; default cuda when available
    dtype: str = "auto"
    ignore_eos: bool = False
    max_prompt_tokens: int | None = None
    hf_cache_dir: str | None = None
    trust_remote_code: bool = False  # run the verifier folder's code (e.g. Kimi-K2.5's tokenizer)
    show_progress: bool = True
    labels: list[str] = field(default_factory=list)  # default: from the draft paths
    allow_other_verifier: bool = False  # run drafts trained for a verifier of other weights
    context_lengths: list[int] = field(default_factory=list)
    """Measure at each of these prompt lengths (`evaluate.context_prompts`; 0: the question
    alone); empty: the plain prompts once."""


@dataclass
class DraftSettings:
    """What a draft folder's config.json says that evaluation needs."""

    verifier: str | None
    speculative_tokens: int
    expects: VerifierShape = field(default_factory=VerifierShape)
    """What the draft needs of its verifier (checked before any model loads)."""
    verifier_fingerprint: str | None = None
    """The final norm and LM head it was trained against, hashed (None: not recorded)."""
    config: Any = field(default=None, repr=False)
    """Its `SpeculatorModelConfig`, as read here: the hf engine loads the draft with it (its
    config.json is not read again)."""


def draft_settings(draft: str) -> DraftSettings:
    """Verifier and default proposal length of a draft folder; errors name the folder."""
    from speculators_vllm016.config import SpeculatorModelConfig, default_speculative_tokens

    if not (Path(draft) / "config.json").is_file():
        raise InvalidInputError(
            f"{draft} is not a draft folder (no config.json); pass --draft <folder>"
        )
    try:
        config = SpeculatorModelConfig.from_pretrained(draft)
    except Exception as error:  # noqa: BLE001 - any unreadable config is the user's to fix
        raise InvalidInputError(f"cannot read the draft config of {draft}: {error}") from error
    speculators = getattr(config, "speculators_config", None)
    recorded = speculators.verifier if speculators else None
    return DraftSettings(
        verifier=recorded.name_or_path if recorded else None,
        speculative_tokens=default_speculative_tokens(config),
        expects=expected_verifier(config),
        verifier_fingerprint=getattr(recorded, "weights_fingerprint", None),
        config=config,
    )


def named_verifier(settings: list[DraftSettings]) -> str:
    """The verifier the drafts name, without --verifier. The weights' fingerprint is a
    verifier's identity and its recorded path a hint: drafts that name other paths (a copied or
    moved target folder) with one fingerprint share a verifier, the first of their paths that
    exists here (`_check_trained_for` then checks its weights)."""
    named = list(dict.fromkeys(s.verifier for s in settings))
    if len(named) == 1 and named[0] is not None:
        return named[0]
    fingerprints = {s.verifier_fingerprint for s in settings}
    if None not in named and None not in fingerprints and len(fingerprints) == 1:
        here = [path for path in named if Path(path).exists()]
        if here:
            logger.info(
                "the drafts name verifiers %s with the same weights (fingerprint %s): using %s",
                named,
                fingerprints.pop(),
                here[0],
            )
            return here[0]
    raise InvalidInputError(
        f"the drafts name verifiers {sorted(map(str, set(named)))}"
        f"{'' if len(fingerprints) == 1 else ' of different weights'}; pass --verifier <model>"
    )


def _check_trained_for(
    options: EvalOptions, settings: list[DraftSettings], verifier_path: str, config_dict: dict
) -> None:
    """Refuse a draft whose recorded verifier weights (final norm and LM head) differ from the
    verifier's: same shapes, other model; it would be measured against targets it never saw."""
    if options.allow_other_verifier or not any(s.verifier_fingerprint for s in settings):
        return
    from speculators_vllm016.utils.verifier_weights import VerifierInfo

    # The config already read (`config_dict`) is not read again.
    mine = VerifierInfo.read(verifier_path, config_dict).fingerprint()
    for draft, setting in zip(options.drafts, settings, strict=True):
        if setting.verifier_fingerprint and setting.verifier_fingerprint != mine:
            raise InvalidInputError(
                f"the draft {draft} was trained against a verifier whose final norm and LM head "
                f"differ from those of {verifier_path}; evaluate it with the verifier it was trained "
                "for (--verifier), or pass --allow-other-verifier to measure it against this one"
            )


def resolve_engine(engine: str) -> str:
    """`auto` is vllm where vLLM on an accelerator can speculate, else hf; `vllm` fails fast if
    this vLLM can't speculate at all. On vLLM's CPU build `auto` stays hf: vLLM speculates there
    (this package's plugin) but runs its spec-decode kernels in Triton's interpreter, so it is
    for checking what vLLM counts (`--engine vllm`), not the faster way to measure."""
    from speculators_vllm016.evaluate.vllm_engine import (
        on_cpu_build,
        speculative_decoding_unavailable,
    )

    if engine not in ENGINES:
        raise InvalidInputError(f"unknown engine {engine!r}; use one of {ENGINES}")
    if engine == "hf":
        return "hf"
    reason = speculative_decoding_unavailable()
    if engine == "vllm":
        if reason is not None:
            raise InvalidInputError(f"{reason}; use --engine hf")
        return "vllm"
    return "vllm" if reason is None and not on_cpu_build() else "hf"


def _labels(drafts: list[str]) -> list[str]:
    """Short names: the folder name of one draft, paths below the common folder of several."""
    paths = [os.path.abspath(draft) for draft in drafts]
    root = os.path.commonpath(paths) if len(paths) > 1 else None
    return [
        os.path.relpath(path, root) if root and path != root else (Path(path).name or path)
        for path in paths
    ]


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.float32 if device == "cpu" else "auto"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInputError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return dtype


def _eos_ids(verifier, tokenizer) -> list[int]:
    ids: set[int] = set()
    configured = getattr(verifier.generation_config, "eos_token_id", None)
    for value in configured if isinstance(configured, (list, tuple)) else [configured]:
        if value is not None:
            ids.add(int(value))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def _load_tokenizer(verifier_path: str, trust_remote_code: bool):
    """The verifier's tokenizer; a folder whose tokenizer is its own code (Kimi-K2.5's) needs
    --trust-remote-code, and the error says so."""
    from transformers import AutoTokenizer

    from speculators_vllm016.utils.verifier_config import remote_code_hint

    try:
        return AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
    except ValueError as error:
        hint = remote_code_hint(error, verifier_path)
        if hint is not None:
            raise hint from None
        raise InvalidInputError(str(error)) from error  # transformers refusing the folder


def run_evaluation(options: EvalOptions) -> EvaluationReport:
    """Measure every draft on the same prompts with the same verifier."""
    if not options.drafts:
        raise InvalidInputError("no draft to evaluate; pass --draft <folder> (repeatable)")
    settings = [draft_settings(draft) for draft in options.drafts]
    verifier_path = options.verifier or named_verifier(settings)
    from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

    try:
        verifier_config = load_verifier_config_dict(verifier_path)
    except ValueError as error:
        if options.verifier is not None:
            raise
        raise InvalidInputError(
            f"the verifier the draft names, {verifier_path}, is not found here ({first_line(error)}); "
            "pass --verifier <its folder or hub id>"
        ) from None
    for draft, setting in zip(options.drafts, settings, strict=True):
        check_verifier_matches(draft, setting.expects, verifier_path, verifier_config)
    _check_trained_for(options, settings, verifier_path, verifier_config)
    engine = resolve_engine(options.engine)
    if engine == "hf" and options.tensor_parallel_size != 1:
        raise InvalidInputError(
            f"--tensor-parallel-size {options.tensor_parallel_size} needs the vllm engine; eval runs "
            f"the hf engine here (--engine {options.engine}), which holds the verifier on one device"
        )
    labels = options.labels or _labels(options.drafts)
    _check_context_lengths(options, settings, verifier_config)

    from speculators_vllm016.evaluate.prompts import load_eval_prompts

    tokenizer = _load_tokenizer(verifier_path, options.trust_remote_code)
    prompts = load_eval_prompts(
        options.data_path,
        tokenizer,
        max_prompts=options.max_prompts,
        max_prompt_tokens=options.max_prompt_tokens,
        cache_dir=options.hf_cache_dir,
    )
    logger.info("%d prompts from %s; engine %s", len(prompts.token_ids), options.data_path, engine)
    prompt_sets = _prompt_sets(options, tokenizer, prompts)
    report = EvaluationReport(
        verifier=verifier_path,
        data_path=options.data_path,
        num_prompts=len(prompts.token_ids),
        max_new_tokens=options.max_new_tokens,
        engine=engine,
    )
    # The verifier's config.json as read above goes to the engine's start (not read again).
    verifier = ReadVerifier(verifier_path, verifier_config)
    if engine == "vllm":
        _run_vllm(options, settings, verifier, prompt_sets, labels, report)
    else:
        _run_hf(options, settings, verifier, tokenizer, prompt_sets, labels, report)
    return report


@dataclass(frozen=True)
class ReadVerifier:
    """The verifier an evaluation runs: where it is and its config.json, read once."""

    path: str
    config_dict: dict = field(repr=False)


def _check_context_lengths(options: EvalOptions, settings, verifier_config: dict) -> None:
    """Refuse, before any model loads, a context length whose prompts and answers cannot fit
    in the verifier's positions."""
    from speculators_vllm016.utils.text_config import text_config_of

    limit = text_config_of(verifier_config).get("max_position_embeddings")
    if not options.context_lengths or limit is None:
        return
    k = max(options.num_speculative_tokens or s.speculative_tokens for s in settings)
    longest = max(options.context_lengths)
    if longest + options.max_new_tokens + k + 1 > limit:
        raise InvalidInputError(
            f"--context-lengths {longest} with --max-new-tokens {options.max_new_tokens} and "
            f"{k} speculative tokens needs {longest + options.max_new_tokens + k + 1} positions; "
            f"the verifier has {limit}"
        )


def _prompt_sets(options: EvalOptions, tokenizer, prompts: EvalPrompts) -> list[ContextPrompts]:
    """The prompt sets to measure: the plain prompts, or one set per context length."""
    from speculators_vllm016.evaluate.context_prompts import context_prompt_sets

    if not options.context_lengths:
        return [ContextPrompts(None, prompts.token_ids)]
    return context_prompt_sets(
        options.data_path,
        tokenizer,
        options.context_lengths,
        prompts.rows,
        cache_dir=options.hf_cache_dir,
    )


def _load_draft(path: str, dtype, device: str, config: Any = None):
    """The draft from its folder, on `device`.

    Weights a checkpoint leaves out on purpose (an EAGLE-3 draft's copy of the verifier's LM head,
    used only to score training targets) come back on the meta device; they are not used to
    propose, so they are allocated as zeros rather than loaded.
    """
    import torch

    from speculators_vllm016.model import SpeculatorModel

    # Detached: the evaluation holds the verifier itself; attaching would load it a second time.
    # `config`: the draft's config as `draft_settings` read it (None: read here).
    draft = SpeculatorModel.from_pretrained(
        path, dtype=dtype, verifier_attachment_mode="detached", config=config
    )
    for module in draft.modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                for parameter in module.parameters(recurse=False):
                    parameter.zero_()
    return draft.to(device).eval()


def _draft_evaluation(
    draft_path: str,
    label: str,
    engine: str,
    k: int,
    result: GenerationResult,
    prompts: ContextPrompts,
    training: Any = None,
) -> DraftEvaluation:
    """One draft's row of the report from either engine's result (counts, tokens, seconds) on
    one prompt set. `training`: the draft's `find_training_estimate`, read once per draft."""
    return DraftEvaluation(
        draft=draft_path,
        label=label,
        engine=engine,
        num_speculative_tokens=k,
        counts=result.counts,
        generated_tokens=result.generated_tokens,
        seconds=result.seconds,
        training=training,
        context_length=prompts.context_length,
        prompt_tokens=prompts.mean_prompt_tokens if prompts.context_length is not None else None,
    )


def _fitting(
    prompt_sets: list[ContextPrompts], limit: int | None, room: int
) -> list[ContextPrompts]:
    """The sets without the prompts that leave fewer than `room` of the verifier's `limit`
    positions (warned); one prompt set for every draft, so their rows compare."""
    if limit is None:
        return prompt_sets
    kept = []
    for prompts in prompt_sets:
        usable = [p for p in prompts.token_ids if len(p) + room <= limit]
        if not usable:
            raise InvalidInputError(
                f"every prompt plus --max-new-tokens exceeds the verifier's {limit} positions"
            )
        if len(usable) < len(prompts.token_ids):
            logger.warning(
                "left out %d prompts too long for %d positions",
                len(prompts.token_ids) - len(usable),
                limit,
            )
        kept.append(ContextPrompts(prompts.context_length, usable))
    return kept


def _run_hf(options, settings, verifier: ReadVerifier, tokenizer, prompt_sets, labels, report):
    import torch

    from speculators_vllm016.evaluate.speculative import speculative_generate
    from speculators_vllm016.models.verifier_lm import load_verifier_lm

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _torch_dtype(options.dtype, device)
    # A wrapper (Kimi-K2.5) gives its language model; no vision tower, no code from its folder.
    verifier_lm = load_verifier_lm(
        verifier.path, dtype, options.trust_remote_code, config_dict=verifier.config_dict
    )
    verifier_lm = verifier_lm.to(device).eval()
    eos = [] if options.ignore_eos else _eos_ids(verifier_lm, tokenizer)
    ks = [options.num_speculative_tokens or setting.speculative_tokens for setting in settings]
    limit = getattr(verifier_lm.config, "max_position_embeddings", None)
    # Sized for the largest k, so every draft is measured on the same prompts.
    prompt_sets = _fitting(prompt_sets, limit, options.max_new_tokens + max(ks) + 1)
    report.num_prompts = len(prompt_sets[0].token_ids)
    for draft_path, setting, k, label in zip(options.drafts, settings, ks, labels):
        draft = _load_draft(draft_path, verifier_lm.dtype, device, setting.config)
        training = find_training_estimate(draft_path)
        for prompts in prompt_sets:
            result = speculative_generate(
                verifier_lm,
                draft,
                prompts.token_ids,
                options.max_new_tokens,
                k,
                eos_token_ids=eos,
                batch_size=options.batch_size,
                show_progress=options.show_progress,
            )
            report.drafts.append(
                _draft_evaluation(draft_path, label, "hf", k, result, prompts, training)
            )
        del draft


def _run_vllm(options, settings, verifier: ReadVerifier, prompt_sets, labels, report) -> None:
    from speculators_vllm016.evaluate.vllm_engine import evaluate_prompt_sets_with_vllm

    for draft_path, setting, label in zip(options.drafts, settings, labels):
        k = options.num_speculative_tokens or setting.speculative_tokens
        results = evaluate_prompt_sets_with_vllm(
            draft_path,
            verifier.path,
            [prompts.token_ids for prompts in prompt_sets],
            options.max_new_tokens,
            k,
            tensor_parallel_size=options.tensor_parallel_size,
            dtype=options.dtype,
            ignore_eos=options.ignore_eos,
            show_progress=options.show_progress,
            trust_remote_code=options.trust_remote_code,
            verifier_config=verifier.config_dict,
        )
        training = find_training_estimate(draft_path)
        for prompts, result in zip(prompt_sets, results, strict=True):
            report.drafts.append(
                _draft_evaluation(draft_path, label, "vllm", k, result, prompts, training)
            )
