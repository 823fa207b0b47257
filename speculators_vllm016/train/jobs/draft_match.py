"""Whether a draft to fine-tune (`--from-pretrained`) fits the run: checked before anything is
written, every mismatch named on a line of its own.

A draft fits when it was made for the run's verifier (same architecture and, where the draft
carries the verifier's token embeddings, the very same ones), reads target states of the
verifier's width, embeds its vocabulary, predicts the tokens of the run's vocabulary maps,
fuses the layers the data holds, and has the layer count and norm placement the run asks for.
Training on a draft that misses one of these trains weights that vLLM then feeds other states
or tokens than they were trained on; shapes alone catch only some of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.job_config import TrainSetupError

if TYPE_CHECKING:
    import torch

    from speculators_vllm016.train.jobs.pretrained_draft import PretrainedDraft
    from speculators_vllm016.train.vocab_maps import VocabMaps

__all__ = [
    "DraftMismatchError",
    "RunFacts",
    "check_draft_fits",
    "draft_mismatches",
    "eagle31_flags",
]

logger = logging.getLogger("speculators")


class DraftMismatchError(TrainSetupError):
    """The draft does not fit the run; `details` holds one line per mismatch (the command
    prints them all under the first line)."""

    def __init__(self, source: str, details: list[str]) -> None:
        self.details = list(details)
        header = (
            f"--from-pretrained {source} does not fit this run ({len(details)} mismatch"
            f"{'es' if len(details) > 1 else ''} below; nothing was written)"
        )
        super().__init__("\n".join([header, *(f"  {line}" for line in details)]))


@dataclass
class RunFacts:
    """What the run is made of, as `train.jobs.setup.prepare` found it."""

    verifier: str
    architectures: list[str]
    hidden_size: int
    vocab_size: int
    vocab: VocabMaps
    vocab_source: str
    """Where the run's maps come from (for the message), e.g. the --d2t-path file."""
    layer_ids: list[int] | None
    """The data's captured layers (datagen's numbering, the last one is the teacher's)."""
    aux_ids: list[int] | None
    """The fused ones in vLLM's numbering (datagen's + 1)."""
    num_layers: int
    norm_before_residual: bool
    embeddings: torch.Tensor | None
    """The verifier's token embeddings (None: not read)."""
    eagle31: dict[str, bool] = field(default_factory=dict)
    """The run's EAGLE-3.1 switches by config key (`eagle31_flags`); absent ones are off."""


def eagle31_flags(model: Any) -> dict[str, bool]:
    """The EAGLE-3.1 switches of a job's `ModelConfig` (or a draft config), by config key."""
    from speculators_vllm016.utils.eagle31 import EAGLE31_FIELDS

    return {name: bool(getattr(model, name, False)) for name in EAGLE31_FIELDS}


def _verifier_lines(draft: PretrainedDraft, run: RunFacts) -> list[str]:
    import torch

    lines = []
    named = draft.config.speculators_config.verifier if draft.config.speculators_config else None
    architectures = list(named.architectures or []) if named is not None else []
    if architectures and run.architectures and architectures != run.architectures:
        lines.append(
            f"verifier: the draft was made for {'/'.join(architectures)} ({named.name_or_path}), "
            f"this run's verifier {run.verifier} is {'/'.join(run.architectures)}"
        )
    elif named is not None and named.name_or_path and named.name_or_path != run.verifier:
        logger.info(
            "the draft names its verifier %s; fine-tuning it for %s (same architecture)",
            named.name_or_path,
            run.verifier,
        )
    own = draft.weights.get("embed_tokens.weight")
    if own is not None and run.embeddings is not None and own.shape == run.embeddings.shape:
        # Both as the draft stores them: a bf16 draft holds the verifier's values rounded to bf16.
        if not torch.equal(own, run.embeddings.to(own.dtype)):
            lines.append(
                f"verifier identity: the draft's token embeddings are not {run.verifier}'s: it was "
                "trained for another model (or another revision of it)"
            )
    return lines


def _shape_lines(draft: PretrainedDraft, run: RunFacts) -> list[str]:
    config = draft.config
    layer = config.transformer_layer_config
    lines = []
    reads = int(config.target_hidden_size or layer.hidden_size)
    if reads != run.hidden_size:
        lines.append(
            f"hidden size: the draft reads target states {reads} wide (target_hidden_size), the "
            f"verifier's are {run.hidden_size}"
        )
    if int(layer.vocab_size) != run.vocab_size:
        lines.append(
            f"target vocabulary: the draft embeds {layer.vocab_size} tokens, the verifier has "
            f"{run.vocab_size}"
        )
    if int(layer.num_hidden_layers) != run.num_layers:
        lines.append(
            f"layers: the draft has {layer.num_hidden_layers} decoder "
            f"layer{'' if layer.num_hidden_layers == 1 else 's'}, this run --num-layers {run.num_layers}"
        )
    if (
        draft.records_norm_before_residual
        and bool(config.norm_before_residual) != run.norm_before_residual
    ):
        flag = "--norm-before-residual" if run.norm_before_residual else "--no-norm-before-residual"
        lines.append(
            f"norm before residual: the draft has norm_before_residual={config.norm_before_residual}, "
            f"this run {flag}"
        )
    for name, draft_on in eagle31_flags(config).items():
        if draft_on != run.eagle31.get(name, False):
            flag = f"--{name.replace('_', '-')}"
            lines.append(
                f"{name}: the draft has {name}={draft_on}, this run "
                f"{'gives' if not draft_on else 'leaves out'} {flag}"
            )
    return lines


def _vocab_lines(draft: PretrainedDraft, run: RunFacts) -> list[str]:
    import torch

    size = int(draft.config.draft_vocab_size)
    run_size = int(run.vocab.d2t.shape[0])
    if size != run_size:
        return [
            f"draft vocabulary: the draft predicts {size} tokens (draft_vocab_size), this run's "
            f"maps ({run.vocab_source}) {run_size}"
        ]
    d2t, t2d = draft.weights.get("d2t"), draft.weights.get("t2d")
    if d2t is None or t2d is None or t2d.shape != run.vocab.t2d.shape:
        return []
    if not (torch.equal(d2t.long(), run.vocab.d2t) and torch.equal(t2d.bool(), run.vocab.t2d)):
        return [
            f"vocabulary maps: the draft's d2t/t2d pick other tokens than this run's "
            f"({run.vocab_source}); leave out --d2t-path/--t2d-path/--draft-vocab-size to train "
            "with the draft's own"
        ]
    return []


def _layer_lines(draft: PretrainedDraft, run: RunFacts) -> list[str]:
    recorded = draft.config.eagle_aux_hidden_state_layer_ids
    if run.aux_ids is None:
        return []
    if not recorded:
        logger.warning(
            "--from-pretrained %s does not record which target layers it fuses "
            "(eagle_aux_hidden_state_layer_ids); it cannot be checked against the data's: the "
            "fine-tune trains and records %s (vLLM's numbering)",
            draft.source,
            run.aux_ids,
        )
        return []
    if [int(i) for i in recorded] != list(run.aux_ids):
        return [
            f"fused layers: the draft fuses target layers {list(recorded)} (vLLM's numbering), the "
            f"data holds {run.aux_ids} (its layer ids {run.layer_ids[:-1] if run.layer_ids else []} "
            "+ 1)"
        ]
    return []


def draft_mismatches(draft: PretrainedDraft, run: RunFacts) -> list[str]:
    """One line per way `draft` does not fit `run`, in a fixed order; empty when it fits."""
    return [
        *_verifier_lines(draft, run),
        *_shape_lines(draft, run),
        *_vocab_lines(draft, run),
        *_layer_lines(draft, run),
    ]


def check_draft_fits(draft: PretrainedDraft, run: RunFacts) -> None:
    """Raise `DraftMismatchError` listing every mismatch."""
    lines = draft_mismatches(draft, run)
    if lines:
        raise DraftMismatchError(draft.source, lines)
