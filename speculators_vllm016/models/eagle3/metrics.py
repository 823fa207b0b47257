"""The eager scoring of 0.3.0: its per-step KL loss, top-1 accuracies and metrics.

The forward pass scores with the fused `fused_loss.linear_kl_loss` (through
`scoring.score_ttt_step`); these are the plain versions over whole logits that 0.3.0 exposed,
kept for user code and as the reference the fused path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculators_vllm016.models.eagle3.scoring import align_for_step

__all__ = ["accuracy_from_ids", "compute_accuracy", "compute_metrics", "loss_function"]


@torch.no_grad()
def accuracy_from_ids(
    predicted: torch.Tensor,
    target: torch.Tensor,
    loss_mask: torch.Tensor | None,
    prev_correct: torch.Tensor | None,
):
    """`(full, conditional)` top-1 agreement of aligned token ids (see `compute_accuracy`)."""
    correct = predicted == target
    conditional_denominator: torch.Tensor | int = correct.numel()
    if prev_correct is not None:
        conditional_denominator = prev_correct.sum()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)
    if loss_mask is not None:
        correct = correct[loss_mask.to(torch.bool)]
    hits = correct.float().sum()
    return hits / (correct.numel() + 1e-5), hits / (conditional_denominator + 1e-5)


@torch.no_grad()
def compute_accuracy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None,
    prev_correct: torch.Tensor | None,
):
    """`(full, conditional)` top-1 agreement with the target.

    Full: over all (masked) positions, right at this step and every earlier one. Conditional:
    the same hits over the positions whose earlier steps were all right. `prev_correct` is
    updated in place to "right at every step so far".
    """
    return accuracy_from_ids(logits.argmax(dim=-1), targets.argmax(dim=-1), loss_mask, prev_correct)


def loss_function(
    logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None
) -> torch.Tensor:
    """KL(target || draft) per position, averaged over the trained positions of each row."""
    log_draft = F.log_softmax(logits.float(), dim=-1)
    target_probs = F.softmax(targets.float(), dim=-1)
    per_token = F.kl_div(log_draft, target_probs, reduction="none", log_target=False).sum(-1)
    if loss_mask is not None:
        per_token = per_token * loss_mask
        denominator: torch.Tensor | int = loss_mask.sum(dim=1) + 1e-5
    else:
        denominator = per_token.shape[1]
    return (per_token.sum(dim=1) / denominator).mean()


def compute_metrics(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None,
    prev_correct: torch.Tensor | None,
    ttt_step: int,
    ttt_step_loss_decay: float,
) -> tuple[torch.Tensor, dict]:
    """Weighted loss of one TTT step and its metrics `loss_k`, `full_acc_k`, `cond_acc_k`."""
    step_logits, step_targets, step_mask, step_prev = align_for_step(
        logits, targets, loss_mask, prev_correct, ttt_step
    )
    loss = (ttt_step_loss_decay**ttt_step) * loss_function(step_logits, step_targets, step_mask)
    full, conditional = compute_accuracy(step_logits, step_targets, step_mask, step_prev)
    metrics = {
        f"loss_{ttt_step}": loss.detach().clone(),
        f"full_acc_{ttt_step}": full,
        f"cond_acc_{ttt_step}": conditional,
    }
    return loss, metrics
