"""Scoring the TTT steps of one forward pass: which positions each step scores, which it must
run at all, and each step's fused loss and accuracies.

Alignment (see `core`): draft position i of step k is scored against the target's position
i + k (`align_for_step`), where the loss mask of i + k holds and i and i + k lie in one packed
sample. `ScoringPass` holds what the steps of one forward pass share; `score_ttt_step` scores one
step from a `TTTStepInput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculators_vllm016.models.eagle3.fused_loss import WeightGradSink, linear_kl_loss
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "MAX_USED_FRACTION_TO_SKIP",
    "ScoringPass",
    "StepScore",
    "TTTStepInput",
    "align_for_step",
    "score_ttt_step",
    "scored_position_counts",
    "used_positions",
]

# A TTT step's layer runs over a subset of the positions only where the subset leaves out at
# least a tenth of them: the gathers and scatters around the subset cost memory (copies kept
# for the backward pass) that a few percent less matmul work does not repay.
MAX_USED_FRACTION_TO_SKIP = 0.9


def align_for_step(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None,
    prev_correct: torch.Tensor | None,
    ttt_step: int,
):
    """Pair draft position i of step k with the target's position i + k (both `[1, seq, V]`)."""
    if ttt_step > 0:
        logits = logits[:, :-ttt_step]
        if prev_correct is not None:
            prev_correct = prev_correct[:, :-ttt_step]
    targets = targets[:, ttt_step:]
    if loss_mask is not None:
        loss_mask = loss_mask[:, ttt_step:]
    return logits, targets, loss_mask, prev_correct


def same_sample_as_target(documents: torch.Tensor, ttt_step: int) -> torch.Tensor:
    """`[T]` bool, indexed like the targets: True at j when position j - ttt_step (the draft
    position scored against target j at this step) lies in the same packed sample as j."""
    keep = torch.zeros_like(documents, dtype=torch.bool)
    keep[ttt_step:] = documents[ttt_step:] == documents[: documents.numel() - ttt_step]
    return keep


@dataclass
class StepScore:
    """One TTT step's weighted loss (differentiable), accuracies and draft argmax `[rows]`."""

    loss: torch.Tensor
    full_acc: torch.Tensor
    cond_acc: torch.Tensor
    predicted: torch.Tensor


@dataclass
class TTTStepInput:
    """Everything `score_ttt_step` reads to score TTT step k (`ttt_step`) of a row of R positions."""

    hidden: torch.Tensor
    """`[R, H]` the step's normed draft states; logits = `hidden @ head_weight.T`."""
    head_weight: torch.Tensor
    """`[V, H]` the draft head; detached on every step but the one that owns its gradient."""
    target_logits: torch.Tensor
    """`[>= R + k, V]` the row's targets, indexed by position."""
    scored: torch.Tensor
    """Indexed by target position: the loss mask, already cleared where the draft position and
    its target lie in different samples."""
    prev_correct: torch.Tensor
    """`[R]` right at every earlier step (seeded with the loss mask); updated in place."""
    ttt_step: int
    """k: position i is scored against `target_logits[i + k]`."""
    ttt_step_loss_decay: float = 1.0
    """The step's loss is weighted by `decay**k`."""
    valid_rows: int | None = None
    """The row's real length (default R); only the first `valid_rows - k` positions have a target."""
    masked_denominator: bool = True
    """Add 1e-5 to the loss's denominator (a loss mask was given), as 0.3.0 normalises."""
    chunk_size: int = 4096
    """Rows of logits that exist at a time."""
    compiled: bool = False
    """Compile the loss's element-wise work."""
    head_compute: torch.Tensor | None = None
    """The head already cast to the compute dtype (once per forward pass)."""
    weight_grad_sink: WeightGradSink | None = None
    """The head gradient shared by the steps of the pass (see `WeightGradSink`)."""
    target_ids: torch.Tensor | None = None
    """`target_logits.argmax(-1)`, once per forward pass (computed here when None)."""
    scored_rows: int | None = None
    """The count of scored positions (`scored_position_counts`), known on the host: the loss's
    gradient matmuls then skip the others."""
    used: torch.Tensor | None = None
    """`[R]` bool, the positions whose draft token anything reads (`used_positions`); the others
    get -1 (see `linear_kl_loss`). Needs `used_rows` and `scored_rows`."""
    used_rows: int | None = None
    """How many positions `used` marks."""


def score_ttt_step(step: TTTStepInput) -> StepScore:
    """Score one TTT step as the forward does.

    Loss: `decay**k * sum_i KL_i * scored[i+k] / (sum scored + eps)`, eps = 1e-5 when
    `masked_denominator`, else 0. Full accuracy: hits over the scored positions; conditional:
    the same hits over the positions right at every earlier step. `prev_correct` is updated.
    """
    k = step.ttt_step
    rows = step.hidden.shape[0]
    valid = (step.valid_rows if step.valid_rows is not None else rows) - k
    aligned_mask = _aligned_scored(step.scored, k, rows, valid)
    denominator = aligned_mask.sum() + (1e-5 if step.masked_denominator else 0.0)
    row_weights = aligned_mask.float() * (step.ttt_step_loss_decay**k) / denominator
    step_targets = step.target_logits[k : k + rows]
    if step_targets.shape[0] < rows:
        raise InvalidInputError(f"target_logits needs at least {rows + k} rows for step {k}")
    loss, predicted = linear_kl_loss(
        step.hidden,
        step.head_weight,
        step_targets,
        row_weights,
        step.chunk_size,
        step.compiled,
        weight_compute=step.head_compute,
        weight_grad_sink=step.weight_grad_sink,
        scored_rows=step.scored_rows,
        used=step.used,
        used_rows=step.used_rows,
    )
    with torch.no_grad():
        # As metrics.accuracy_from_ids, without boolean indexing (no host sync in the step).
        target_ids = step.target_ids
        if target_ids is None:
            target_ids = step.target_logits.argmax(dim=-1)
        target_ids = target_ids[k : k + rows]
        valid = max(valid, 0)
        prev = step.prev_correct[:valid]
        conditional_denominator = prev.sum()
        correct = (predicted[:valid] == target_ids[:valid]) & prev
        prev.copy_(correct)
        hits = (correct & aligned_mask[:valid]).sum().float()
        full = hits / (aligned_mask[:valid].sum() + 1e-5)
        conditional = hits / (conditional_denominator + 1e-5)
    return StepScore(loss, full, conditional, predicted)


def _aligned_scored(scored: torch.Tensor, ttt_step: int, rows: int, valid: int) -> torch.Tensor:
    """`[rows]` bool: draft position i is scored at step `ttt_step` where `scored[i + ttt_step]`,
    for the first `valid` positions (the others have no target)."""
    aligned = torch.zeros(rows, dtype=torch.bool, device=scored.device)
    if valid > 0:
        aligned[:valid] = scored[ttt_step : ttt_step + valid].to(torch.bool)
    return aligned


def scored_position_counts(scored: list[torch.Tensor], valid_rows: int) -> list[int]:
    """How many positions each TTT step scores (`scored[k]` as `score_ttt_step` takes it): one
    host sync for all steps."""
    return _counts(_aligned_masks(scored, valid_rows, valid_rows))


def _aligned_masks(scored: list[torch.Tensor], rows: int, valid_rows: int) -> list[torch.Tensor]:
    """`_aligned_scored` of every TTT step."""
    return [
        _aligned_scored(mask, step, rows, valid_rows - step) for step, mask in enumerate(scored)
    ]


def _counts(masks: list[torch.Tensor]) -> list[int]:
    """The number of set entries of each mask, read in one host sync."""
    return [int(count) for count in torch.stack([mask.sum() for mask in masks]).tolist()]


def used_positions(
    scored: list[torch.Tensor], seed: torch.Tensor, valid_rows: int
) -> list[torch.Tensor]:
    """Per TTT step, `[rows]` bool: the draft positions whose step output the loss or the
    metrics read (`scored[k]` as `score_ttt_step` takes it; `seed` the `prev_correct` it starts
    from, `rows` long; `valid_rows` the real length).

    Step k's output at position i feeds only position i of the later steps (their keys are
    read by the same position alone), so it is read where step k or a later one scores i, and,
    before the last step, where `seed` holds: the conditional accuracies count those positions'
    earlier hits whether they are scored or not. The sets shrink from step to step.
    """
    return _used_from_aligned(_aligned_masks(scored, seed.shape[0], valid_rows), seed)


def _used_from_aligned(aligned: list[torch.Tensor], seed: torch.Tensor) -> list[torch.Tensor]:
    """`used_positions` from the steps' `_aligned_scored` masks (for callers that have them)."""
    last = len(aligned) - 1
    used: list[torch.Tensor] = []
    later = torch.zeros_like(seed, dtype=torch.bool)
    for step in range(last, -1, -1):
        later = later | aligned[step]
        if step < last:
            later = later | seed
        used.append(later)
    return used[::-1]


@dataclass
class ScoringPass:
    """What the TTT steps of one scored forward pass share, and the loss and metrics they add up.

    Built by `ScoringPass.start` from the row's targets and masks; `select_used_positions`
    (optional) picks the positions each step's layer must run; `score(step, ...)` scores a step.
    """

    targets: torch.Tensor
    """`[padded + steps, V]` the verifier's logits, one spare row per step."""
    target_ids: torch.Tensor
    """`targets.argmax(-1)`."""
    scored: list[torch.Tensor]
    """Per step, indexed by target position: the loss mask within one sample."""
    prev_correct: torch.Tensor
    """`[padded]` right at every step so far (seeded with the loss mask)."""
    valid_rows: int
    """The row's real length (without flex padding)."""
    masked_denominator: bool
    """A loss mask was given (0.3.0's normalisation)."""
    loss_decay: float
    """`ttt_step_loss_decay`."""
    chunk_size: int
    """Rows of logits that exist at a time."""
    compiled: bool
    """Compile the loss's element-wise work."""
    head_compute: torch.Tensor
    """The draft head in the compute dtype, cast once for all steps."""
    head_grad: WeightGradSink | None
    """The head's one gradient, when it is trained."""
    scored_counts: list[int] | None = None
    """Per step, how many positions it scores (read on the host), once known."""
    used: list[torch.Tensor] = field(default_factory=list)
    """Per step, the positions whose output anything reads (empty: all)."""
    used_counts: list[int] = field(default_factory=list)
    """How many positions each of `used` marks."""
    positions: list[torch.Tensor | None] = field(default_factory=list)
    """Per step, the positions its layer runs over (None: all)."""
    loss: torch.Tensor | None = None
    """The sum of the steps' weighted losses so far."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """`loss_k`, `full_acc_k`, `cond_acc_k` of the steps so far."""

    @classmethod
    def start(
        cls,
        *,
        targets: torch.Tensor,
        target_ids: torch.Tensor,
        loss_mask: torch.Tensor | None,
        documents: torch.Tensor,
        total: int,
        padded: int,
        steps: int,
        loss_decay: float,
        chunk_size: int,
        compiled: bool,
        head_compute: torch.Tensor,
        head_grad: WeightGradSink | None,
    ) -> ScoringPass:
        """The masks of every step: the loss mask (`[1, total]`, None: all) on the real
        positions, within one sample (`documents`, `[padded]`), never past the row's end."""
        device = targets.device
        base_mask = torch.ones(padded + steps, dtype=torch.bool, device=device)
        if loss_mask is not None:
            base_mask[:total] = loss_mask[0].to(torch.bool)
        base_mask[total:] = False
        scored = []
        for step in range(steps):
            mask = base_mask.clone()
            mask[:padded] &= same_sample_as_target(documents, step)
            scored.append(mask)
        return cls(
            targets=targets,
            target_ids=target_ids,
            scored=scored,
            prev_correct=base_mask[:padded].clone(),
            valid_rows=total,
            masked_denominator=loss_mask is not None,
            loss_decay=loss_decay,
            chunk_size=chunk_size,
            compiled=compiled,
            head_compute=head_compute,
            head_grad=head_grad,
            positions=[None] * steps,
            loss=torch.zeros((), dtype=torch.float32, device=device),
        )

    @property
    def steps(self) -> int:
        return len(self.scored)

    def select_used_positions(self) -> None:
        """Run each step's layer only over the positions whose output is read (`used_positions`)
        where that leaves out at least `1 - MAX_USED_FRACTION_TO_SKIP` of the row's real
        positions. Padding (never used) does not count: a row padded to the run's length takes
        the path a full row with its masks takes, and compiles nothing that one did not."""
        padded = self.prev_correct.shape[0]
        aligned = _aligned_masks(self.scored, padded, self.valid_rows)
        self.used = _used_from_aligned(aligned, self.prev_correct)
        # One host read before step 0's layer, which needs the first set; the targets'
        # matmul keeps the device busy meanwhile.
        counts = _counts(aligned + self.used)
        self.scored_counts, self.used_counts = counts[: self.steps], counts[self.steps :]
        self.positions = [
            torch.nonzero_static(used, size=count).squeeze(1)
            if count <= MAX_USED_FRACTION_TO_SKIP * self.valid_rows
            else None
            for used, count in zip(self.used, self.used_counts, strict=True)
        ]

    def count_scored_positions(self) -> None:
        """Read how many positions each step scores (one host sync), if not known yet."""
        if self.scored_counts is None:
            self.scored_counts = scored_position_counts(self.scored, self.valid_rows)

    def score(self, step: int, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Score step `step` of normed states `hidden` `[padded, H]`, add its loss and metrics;
        returns its draft argmax `[padded]` (-1 where nothing reads it)."""
        result = score_ttt_step(
            TTTStepInput(
                hidden=hidden,
                head_weight=head_weight,
                target_logits=self.targets,
                scored=self.scored[step],
                prev_correct=self.prev_correct,
                ttt_step=step,
                ttt_step_loss_decay=self.loss_decay,
                valid_rows=self.valid_rows,
                masked_denominator=self.masked_denominator,
                chunk_size=self.chunk_size,
                compiled=self.compiled,
                head_compute=self.head_compute,
                weight_grad_sink=self.head_grad,
                target_ids=self.target_ids,
                scored_rows=self.scored_counts[step] if self.scored_counts is not None else None,
                used=self.used[step] if self.used else None,
                used_rows=self.used_counts[step] if self.used else None,
            )
        )
        self.loss = self.loss + result.loss
        self.metrics[f"loss_{step}"] = result.loss.detach().clone()
        self.metrics[f"full_acc_{step}"] = result.full_acc
        self.metrics[f"cond_acc_{step}"] = result.cond_acc
        return result.predicted

    def final_metrics(self) -> dict[str, torch.Tensor]:
        """The steps' metrics and their summed `loss`."""
        self.metrics["loss"] = self.loss.detach().clone()
        return self.metrics
