"""The EAGLE-3 draft model and its training objective.

The draft fuses three auxiliary hidden states of the target (`fc`), runs one decoder layer on
`[token embedding ; fused state]`, and predicts over a reduced draft vocabulary (`d2t` maps draft
ids back to target ids, `t2d` marks the kept target ids). Training unrolls `ttt_steps` test-time
steps: each step feeds the draft's own previous prediction and hidden state back in, and is scored
against the target's distribution `ttt_step` tokens further ahead.

Alignment (after the trainer's `shift_batch`): position i holds the token x[i+1], the target's
fused states of token i, and `verifier_last_hidden_states` of token i+1, so `target_logits[i]`
is the target's distribution of x[i+2]. Step k at position i predicts x[i+k+2] and is scored
against `target_logits[i+k]` (`align_for_step`); a pair whose two positions lie in different
packed samples is not scored.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3.attention import (
    ATTENTION_INTERFACE_NAME,
    FLEX_BLOCK_SIZE,
    build_step_zero_mask,
    document_ids,
    extend_mask_for_draft_tokens,
)
from speculators_vllm016.models.eagle3.config import Eagle3SpeculatorConfig
from speculators_vllm016.models.eagle3.model_definitions import (
    FirstLayerWeightCache,
    autocast_dtype,
    maybe_compiled,
    model_classes,
)
from speculators_vllm016.utils.layer_ids import eagle3_aux_layer_ids

__all__ = [
    "AttentionBackend",
    "DraftLMHead",
    "Eagle3DraftModel",
    "Eagle3DraftOutput",
    "accuracy_from_ids",
    "align_for_step",
    "compute_accuracy",
    "compute_metrics",
    "linear_kl_loss",
    "loss_function",
    "score_ttt_step",
    "scored_position_counts",
    "WeightGradSink",
]

AttentionBackend = Literal["auto", "flex", "sdpa"]


# Where verifiers keep (embeddings, final norm, LM head): plain causal LMs, multimodal wrappers
# (Llama-4 / Qwen-VL style), Kimi-K2.5 style wrappers, bare language models.
VERIFIER_WEIGHT_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
    ("model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight"),
    (
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ),
    ("embed_tokens.weight", "norm.weight", "lm_head.weight"),
)


# A TTT step's layer runs over a subset of the positions only where the subset leaves out at
# least a tenth of them: the gathers and scatters around the subset cost memory (copies kept
# for the backward pass) that a few percent less matmul work does not repay.
MAX_USED_FRACTION_TO_SKIP = 0.9


@dataclass
class Eagle3DraftOutput:
    """What one `Eagle3DraftModel.forward` produced.

    `draft_tokens[k]` `[1, T]` are step k's argmax (draft ids). `loss` and `metrics` are set when
    `verifier_last_hidden_states` was given, else None. `logits[k]` are step k's draft logits,
    kept only when asked for (`output_logits=True`).

    It unpacks as 0.3.0's return value did: `draft_tokens, loss, metrics = out` when scored,
    and as the list of draft tokens itself when not (`for tokens in out`, `out[0]`, `len(out)`).
    """

    draft_tokens: list[torch.Tensor]
    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None
    logits: list[torch.Tensor] | None = None

    def as_tuple(self) -> tuple | list[torch.Tensor]:
        """0.3.0's return value: `(draft_tokens, loss, metrics)` when scored, else `draft_tokens`."""
        if self.loss is None:
            return self.draft_tokens
        return (self.draft_tokens, self.loss, self.metrics)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return len(self.as_tuple())

    def __getitem__(self, index: int) -> Any:
        return self.as_tuple()[index]


# DDP finds the tensors of a forward's output by pytree flattening. A plain dataclass is one
# opaque leaf there, and DDP with `static_graph=True` then never routes the loss through its
# backward hook: its ranks silently skip the gradient all-reduce and train apart. Registered,
# the output is taken apart and rebuilt like a tuple.
pytree.register_dataclass(Eagle3DraftOutput)


def _rms_norm_eps(config_dict: dict) -> float | None:
    """The verifier's `rms_norm_eps`, at the top of its config or in its text config."""
    for candidate in (config_dict, config_dict.get("text_config"), config_dict.get("language_config")):
        if isinstance(candidate, dict) and candidate.get("rms_norm_eps") is not None:
            return float(candidate["rms_norm_eps"])
    return None


def _same_sample_as_target(documents: torch.Tensor, ttt_step: int) -> torch.Tensor:
    """`[T]` bool, indexed like the targets: True at j when position j - ttt_step (the draft
    position scored against target j at this step) lies in the same packed sample as j."""
    keep = torch.zeros_like(documents, dtype=torch.bool)
    keep[ttt_step:] = documents[ttt_step:] == documents[: documents.numel() - ttt_step]
    return keep


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


def _kl_chunk(logits: torch.Tensor, targets: torch.Tensor, row_weights: torch.Tensor):
    """Weighted KL(target || draft) of a chunk of rows, its gradient w.r.t. the logits, argmax."""
    log_draft = torch.log_softmax(logits.float(), dim=-1)
    log_target = torch.log_softmax(targets.float(), dim=-1)
    target_probs = log_target.exp()
    per_row = (target_probs * (log_target - log_draft)).sum(-1)
    weights = row_weights.float()
    grad = (log_draft.exp() - target_probs) * weights[:, None]
    return (per_row * weights).sum(), grad.to(logits.dtype), logits.argmax(dim=-1)


def _kl_rows(
    logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor
):
    """`_kl_chunk` of the rows `rows` of `targets` and `row_weights` (compiled, the gather is
    part of the kernel's loads: no copy of the target rows)."""
    return _kl_chunk(logits, targets[rows], row_weights[rows])


def _accumulate_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """`total += left @ right` in place, as one matmul where the dtypes allow (an fp32 `total`
    over bf16 factors on CUDA too)."""
    if total.dtype == left.dtype:
        return torch.addmm(total, left, right, out=total)
    if total.device.type == "cuda" and total.dtype == torch.float32:
        return torch.addmm(total, left, right, out_dtype=torch.float32, out=total)
    return total.add_((left @ right).to(total.dtype))


class WeightGradSink:
    """One gradient of a weight shared by several `linear_kl_loss` calls (the TTT steps of one
    forward pass) whose losses are summed into one loss.

    Every call adds its part in its forward pass, into one `[vocab, hidden]` buffer in the
    compute dtype (accumulated by the matmuls themselves, as autograd sums the steps' gradients
    of every other weight in that dtype). Exactly one call, the owner, takes the weight itself;
    the others take `weight.detach()`. The owner's backward hands the total over, scaled by its
    upstream gradient (the same for all calls, as their losses are summed). With one
    differentiable use the weight's gradient is complete, and accumulated, as soon as the
    owner's backward has run (autograd accumulates a leaf's gradient once all its uses have run
    backward, before anything else that is ready): make the owner the call made last, whose
    backward runs first, and a data-parallel wrapper can reduce the gradient while the rest of
    the backward pass runs.
    """

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.has_owner = False

    def add(
        self, shape: torch.Size, device: torch.device, dtype: torch.dtype, owner: bool
    ) -> torch.Tensor:
        """The buffer a new call accumulates into (zeros at the first call)."""
        if owner:
            if self.has_owner:
                raise ValueError(
                    "a WeightGradSink hands its total to one call: pass the weight itself to "
                    "one linear_kl_loss call and weight.detach() to the others"
                )
            self.has_owner = True
        if self.total is None:
            self.total = torch.zeros(shape, dtype=dtype, device=device)
        return self.total


class _LinearKL(torch.autograd.Function):
    """`sum_i w_i KL(softmax(t_i) || softmax(h_i W^T))` without keeping `[rows, vocab]` tensors.

    The logits exist one chunk of rows at a time; their gradients w.r.t. `hidden` and `weight`
    are formed in the forward pass (so nothing is recomputed) and scaled in the backward pass.
    `weight_compute` is `weight` in the compute dtype when the caller has it already (one cast
    per forward pass), and `sink` a `WeightGradSink` shared with the other steps (every call
    adds to it; the one given the weight itself, not detached, hands the total over).
    With `scored_rows` (the count of rows whose weight is not zero) the rows are taken scored
    ones first: the others (masked prompt tokens, sample boundaries) only get their argmax, and
    the two gradient matmuls run over the scored rows alone. With `used` (`[rows]` bool, a
    superset of the scored rows) and its count `used_rows`, the rows outside it get no argmax
    either: their `predicted` is -1.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, weight_compute, targets, row_weights, chunk_size, compiled, sink,
        scored_rows, used, used_rows,
    ):
        rows = hidden.shape[0]
        compute = hidden.dtype
        w = weight_compute if weight_compute is not None else weight.to(compute)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        order = None
        argmax_rows = rows if used is None else used_rows
        graded = rows if scored_rows is None else scored_rows
        if graded < rows:
            # Scored rows first, then the used ones, then the rest. Stable: the scored rows keep
            # their order, and so does the summation.
            key = (row_weights == 0).to(torch.int32)
            if used is not None:
                key += (~used).to(torch.int32)
            order = torch.argsort(key, stable=True)
        grad_hidden = None
        if need_hidden:
            grad_hidden = torch.empty_like(hidden) if order is None else torch.zeros_like(hidden)
        grad_weight = None
        if sink is not None:
            grad_weight = sink.add(weight.shape, weight.device, compute, owner=need_weight)
        elif need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if argmax_rows < rows:
            predicted = torch.full((rows,), -1, dtype=torch.long, device=hidden.device)
        else:
            predicted = torch.empty(rows, dtype=torch.long, device=hidden.device)
        chunk_math = maybe_compiled(_kl_chunk if order is None else _kl_rows, compiled)
        for start in range(0, graded, chunk_size):
            end = min(start + chunk_size, graded)
            if order is None:
                index = slice(start, end)
                chunk_args = (targets[index], row_weights[index])
            else:
                index = order[start:end]
                chunk_args = (targets, index, row_weights)
            part = hidden[index]
            logits = part @ w.T
            loss, grad_logits, predicted[index] = chunk_math(logits, *chunk_args)
            total += loss
            if grad_hidden is not None:
                grad_hidden[index] = grad_logits @ w
            if grad_weight is not None:
                _accumulate_product(grad_weight, grad_logits.T, part)
            del logits, grad_logits  # before the next chunk's are made: one chunk alive at a time
        for start in range(graded, argmax_rows, chunk_size):  # rows of weight zero: the argmax only
            index = order[start : min(start + chunk_size, argmax_rows)]
            predicted[index] = (hidden[index] @ w.T).argmax(dim=-1)
        ctx.weight_dtype = weight.dtype
        ctx.sink = sink
        ctx.save_for_backward(grad_hidden, None if sink is not None else grad_weight)
        ctx.mark_non_differentiable(predicted)
        return total, predicted

    @staticmethod
    def backward(ctx, grad_total, _grad_predicted):
        grad_hidden, grad_weight = ctx.saved_tensors
        if ctx.sink is not None and ctx.needs_input_grad[1]:
            grad_weight = ctx.sink.total
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def linear_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_size: int = 4096,
    compiled: bool = False,
    *,
    weight_compute: torch.Tensor | None = None,
    weight_grad_sink: WeightGradSink | None = None,
    scored_rows: int | None = None,
    used: torch.Tensor | None = None,
    used_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sum_i row_weights[i] * KL(softmax(target_logits[i]) || softmax(hidden[i] @ weight.T)),
    argmax_i)` for `hidden [N, H]`, `target_logits [N, V]`, computed `chunk_size` rows at a time.

    `weight_compute`: `weight` already cast to the compute dtype (detached); `weight_grad_sink`:
    a `WeightGradSink` shared by calls whose losses are summed, one of which takes `weight`
    itself and the others `weight.detach()` (see there); `scored_rows`: how
    many `row_weights` are not zero, when the caller knows it without waiting for the device
    (the gradient matmuls then skip the other rows; a wrong count drops scored rows);
    `used` / `used_rows`: the rows whose argmax anyone reads (a superset of the scored ones, with
    `scored_rows`) and their count; the others get none (-1).
    """
    if used is not None and (scored_rows is None or used_rows is None):
        raise ValueError("`used` needs its count `used_rows` and `scored_rows`")
    return _LinearKL.apply(
        hidden, weight, weight_compute, target_logits, row_weights, chunk_size, compiled,
        weight_grad_sink, scored_rows, used, used_rows,
    )


@dataclass
class StepScore:
    """One TTT step's weighted loss (differentiable), accuracies and draft argmax `[rows]`."""

    loss: torch.Tensor
    full_acc: torch.Tensor
    cond_acc: torch.Tensor
    predicted: torch.Tensor


def score_ttt_step(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    target_logits: torch.Tensor,
    scored: torch.Tensor,
    prev_correct: torch.Tensor,
    ttt_step: int,
    ttt_step_loss_decay: float = 1.0,
    *,
    valid_rows: int | None = None,
    masked_denominator: bool = True,
    chunk_size: int = 4096,
    compiled: bool = False,
    head_compute: torch.Tensor | None = None,
    weight_grad_sink: WeightGradSink | None = None,
    target_ids: torch.Tensor | None = None,
    scored_rows: int | None = None,
    used: torch.Tensor | None = None,
    used_rows: int | None = None,
) -> StepScore:
    """Score TTT step k (`ttt_step`) of a row of `R` positions, as the forward does.

    `hidden [R, H]` are the step's normed draft states (logits = `hidden @ head_weight.T`);
    `target_logits [>= R + k, V]` the targets of the row, indexed by position; position i is
    scored against `target_logits[i + k]` where `scored[i + k]` (the loss mask of the target
    position, already cleared where i and i + k lie in different samples). Only the first
    `valid_rows - k` positions have a target (`valid_rows` = real length, default R).
    Loss: `decay**k * sum_i KL_i * scored[i+k] / (sum scored + eps)`, eps = 1e-5 when
    `masked_denominator` (a loss mask was given), else 0, as 0.3.0 normalises.
    `prev_correct [R]` (right at every earlier step, seeded with the loss mask) is updated.
    Per forward pass, once for all steps: `head_compute` (the head in the compute dtype),
    `weight_grad_sink` (see `WeightGradSink`), `target_ids` (`target_logits.argmax(-1)`).
    `scored_rows`: the count of scored positions (`scored_position_counts`), known on the host;
    the gradient matmuls of the loss then skip the others. `used` / `used_rows`
    (`used_positions`): the positions whose draft token anything reads, and how many; the
    others get -1 (see `linear_kl_loss`).
    """
    rows = hidden.shape[0]
    valid = (valid_rows if valid_rows is not None else rows) - ttt_step
    aligned_mask = _aligned_scored(scored, ttt_step, rows, valid)
    denominator = aligned_mask.sum() + (1e-5 if masked_denominator else 0.0)
    row_weights = aligned_mask.float() * (ttt_step_loss_decay**ttt_step) / denominator
    step_targets = target_logits[ttt_step : ttt_step + rows]
    if step_targets.shape[0] < rows:
        raise ValueError(f"target_logits needs at least {rows + ttt_step} rows for step {ttt_step}")
    loss, predicted = linear_kl_loss(
        hidden, head_weight, step_targets, row_weights, chunk_size, compiled,
        weight_compute=head_compute, weight_grad_sink=weight_grad_sink, scored_rows=scored_rows,
        used=used, used_rows=used_rows,
    )
    with torch.no_grad():
        # As accuracy_from_ids, without boolean indexing (no host sync in the training step).
        if target_ids is None:
            target_ids = target_logits.argmax(dim=-1)
        target_ids = target_ids[ttt_step : ttt_step + rows]
        valid = max(valid, 0)
        prev = prev_correct[:valid]
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
    return [_aligned_scored(mask, step, rows, valid_rows - step) for step, mask in enumerate(scored)]


def _counts(masks: list[torch.Tensor]) -> list[int]:
    """The number of set entries of each mask, read in one host sync."""
    return [int(count) for count in torch.stack([mask.sum() for mask in masks]).tolist()]


def used_positions(scored: list[torch.Tensor], seed: torch.Tensor, valid_rows: int) -> list[torch.Tensor]:
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


class _StepKeyValues:
    """Keys and values of the TTT steps so far, per layer; each step appends one block.

    Quacks like transformers' `Cache.update` for the layers' attention modules.
    """

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, cache_kwargs=None):
        if layer_idx in self.layers:
            old_key, old_value = self.layers[layer_idx]
            key = torch.cat([old_key, key], dim=-2)
            value = torch.cat([old_value, value], dim=-2)
        self.layers[layer_idx] = (key, value)
        return key, value


class DraftLMHead(nn.Linear):
    """The draft's LM head: a bias-free `nn.Linear` (the same `lm_head.weight` in checkpoints).

    The fused loss reads `weight` directly instead of calling the module, for all TTT steps at
    once. `mark_read` is a call of the module that returns its argument unchanged; the draft
    makes one before its first direct read of a forward pass (no argument) and one on the last
    TTT step's head input. A wrapper that acts on module calls (FSDP2, through
    `register_fsdp_forward_method`) then has the weight gathered before it is read, and
    reduces its gradient as soon as that input's gradient exists. The last step's loss is the
    weight's one differentiable use (see `WeightGradSink`) and the first to run backward, so the
    gradient is complete by then and its reduction overlaps the rest of the backward pass.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def mark_read(self, tensor: torch.Tensor | None = None) -> torch.Tensor | None:
        return tensor


def _final_norm(model: Eagle3DraftModel, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return model.norm(hidden).to(dtype)


@SpeculatorModel.register("eagle3")
class Eagle3DraftModel(SpeculatorModel):
    """EAGLE-3 draft for training and for export to vLLM.

    `Eagle3DraftModel(config, t2d, d2t)` builds a draft for training: the token embeddings, the
    verifier's final norm and the LM head rows of the draft vocabulary are copied from the
    verifier named in the config (embeddings, norm and a copy of the head stay frozen; the frozen
    norm and head turn the verifier's last hidden states into the training targets).
    `Eagle3DraftModel(config)` (as `from_pretrained` does) builds the empty shell whose weights
    come from a checkpoint. `use_verifier_norm=False` scores against the head without the norm,
    as 0.3.0 did (its defect D1).

    Speed knobs (plain attributes, read at every forward): `attention_backend` "flex"
    (block-sparse flex attention, compiled on accelerators), "sdpa" (dense masks) or "auto"
    (flex on CUDA, SDPA elsewhere; a layer config whose `_attn_implementation` is
    "simple_flex_attention" starts at "flex"); `compile_blocks` (None: on CUDA) compiles the
    element-wise work of the first layer and of the loss; `loss_chunk_size` rows of logits exist
    at a time; `skip_unscored_rows` (None: off on CPUs) runs the loss's gradient matmuls over the
    scored positions only (see `linear_kl_loss`). On a CPU it changed the last bits of training
    with the thread count (a resumed run under another OMP_NUM_THREADS was no longer
    bit-identical to the uninterrupted one), and CPU runs are small, so it stays off there.
    `skip_unused_positions` (False; None: on CUDA only; the trainer's choice is None) runs each
    TTT step's layer only over the positions whose output a loss term or metric reads
    (`used_positions`: the last step's scored ones, the earlier steps' scored or loss-masked
    ones) where that leaves out at least a tenth of them (`MAX_USED_FRACTION_TO_SKIP`), for
    single-layer drafts scored without `output_logits`; the loss's row skip comes with it.
    Loss, metrics and gradients are unchanged, but the draft tokens of the other positions are
    not computed (-1), which 0.3.0 never returned: hence off by default.
    Mixed precision: keep the parameters fp32 and run the forward under
    `torch.autocast(device, torch.bfloat16)`; `frozen_weights_to(torch.bfloat16)` halves the
    memory of the frozen verifier copies.
    """

    config_class: ClassVar[type[Eagle3SpeculatorConfig]] = Eagle3SpeculatorConfig  # type: ignore[misc]
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = [  # type: ignore[misc]
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [  # type: ignore[misc]
        "verifier_norm.weight",
    ]
    _keys_to_ignore_on_save: ClassVar[list[str]] = [  # type: ignore[misc]
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]

    def __init__(
        self,
        config: Eagle3SpeculatorConfig,
        t2d: torch.Tensor | None = None,
        d2t: torch.Tensor | None = None,
        *,
        use_verifier_norm: bool = True,
    ) -> None:
        super().__init__(config=config, verifier=None, verifier_attachment_mode="train_only")
        requested = getattr(config.transformer_layer_config, "_attn_implementation", None)
        # The layers get their own copy whose attention is ours (flex or SDPA by mask type);
        # the caller's config is left as it was.
        layer_config = copy.copy(config.transformer_layer_config)
        layer_config._attn_implementation = ATTENTION_INTERFACE_NAME
        self.attention_backend: AttentionBackend = (
            "flex" if requested in (ATTENTION_INTERFACE_NAME, "flex_attention") else "auto"
        )
        self.compile_blocks: bool | None = None
        self.skip_unscored_rows: bool | None = None
        self.skip_unused_positions: bool | None = False
        self.loss_chunk_size = 4096
        if layer_config.model_type not in model_classes:
            raise ValueError(
                f"no EAGLE-3 layer for transformer type {layer_config.model_type!r}; "
                f"supported: {sorted(model_classes)}"
            )
        components = model_classes[layer_config.model_type]
        self.hidden_size = layer_config.hidden_size
        self.target_hidden_size = config.target_hidden_size or self.hidden_size
        self.draft_vocab_size = config.draft_vocab_size
        self.use_verifier_norm = use_verifier_norm
        target_vocab = layer_config.vocab_size
        from_verifier = t2d is not None or d2t is not None
        if from_verifier and (t2d is None or d2t is None):
            raise ValueError("pass both t2d and d2t (or neither, to load from a checkpoint)")
        if t2d is None:
            t2d = torch.zeros(target_vocab, dtype=torch.bool)
            d2t = torch.zeros(self.draft_vocab_size, dtype=torch.long)
        self._check_vocab_maps(t2d, d2t, target_vocab, strict=from_verifier)
        self.register_buffer("t2d", t2d.to(torch.bool))
        self.register_buffer("d2t", d2t.to(torch.long))

        self.fc = nn.Linear(3 * self.target_hidden_size, self.hidden_size, bias=False)
        first = components.first_layer_class(
            layer_config, layer_idx=0, norm_before_residual=config.norm_before_residual
        )
        rest = [
            components.decoder_layer_class(layer_config, index)
            for index in range(1, layer_config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList([first, *rest])
        self.norm = components.norm_class(self.hidden_size, eps=layer_config.rms_norm_eps)
        self.rotary_emb = components.rotary_emb_class(config=layer_config)
        self.embed_tokens = nn.Embedding(target_vocab, self.hidden_size)
        self.lm_head = DraftLMHead(self.hidden_size, self.draft_vocab_size)
        self.verifier_norm: nn.Module | None = (
            components.norm_class(self.target_hidden_size, eps=layer_config.rms_norm_eps)
            if use_verifier_norm
            else None
        )
        self.verifier_lm_head = nn.Linear(
            self.target_hidden_size, self.draft_vocab_size, bias=False
        )
        self.post_init()
        self.embed_tokens.weight.requires_grad_(False)
        self.verifier_lm_head.weight.requires_grad_(False)
        if self.verifier_norm is not None:
            self.verifier_norm.weight.requires_grad_(False)
        if from_verifier:
            self.load_verifier_weights()

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Never tie: the draft head covers the draft vocabulary, the embeddings the target's."""

    def _check_vocab_maps(
        self, t2d: torch.Tensor, d2t: torch.Tensor, target_vocab: int, strict: bool
    ) -> None:
        if t2d.shape != (target_vocab,):
            raise ValueError(f"t2d has shape {tuple(t2d.shape)}, expected ({target_vocab},)")
        if d2t.shape != (self.draft_vocab_size,):
            raise ValueError(
                f"d2t has shape {tuple(d2t.shape)}, expected ({self.draft_vocab_size},)"
            )
        if strict and int(t2d.sum()) != self.draft_vocab_size:
            raise ValueError(
                f"t2d marks {int(t2d.sum())} tokens, expected draft_vocab_size="
                f"{self.draft_vocab_size}"
            )

    def load_verifier_weights(self, verifier_path: str | None = None) -> None:
        """Copy embeddings, the final norm (with its eps) and the draft-vocabulary rows of the
        LM head from the verifier; all three stay frozen."""
        from speculators_vllm016.convert.eagle.utils import load_verifier_config_dict
        from speculators_vllm016.utils.loading import load_model_layers

        verifier = self.config.speculators_config.verifier if self.config.speculators_config else None
        path = verifier_path or (verifier.name_or_path if verifier else None)
        if not path:
            raise ValueError("the config names no verifier (speculators_config.verifier.name_or_path)")
        names = [name for layout in VERIFIER_WEIGHT_LAYOUTS for name in layout]
        weights = load_model_layers(list(dict.fromkeys(names)), path)
        layout = next((lay for lay in VERIFIER_WEIGHT_LAYOUTS if lay[0] in weights), None)
        if layout is None:
            raise ValueError(
                f"{path} has no token embeddings (looked for "
                f"{[lay[0] for lay in VERIFIER_WEIGHT_LAYOUTS]})"
            )
        embed_name, norm_name, head_name = layout
        embeddings = weights[embed_name]
        head = weights.get(head_name, embeddings)  # tied embeddings
        if embeddings.shape != self.embed_tokens.weight.shape:
            raise ValueError(
                f"verifier embeddings {tuple(embeddings.shape)} do not fit the draft's "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab size and hidden size must match)"
            )
        rows = head[self.t2d.to(head.device)]
        dtype = self.lm_head.weight.dtype
        self._materialize_frozen()
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embeddings.to(dtype))
            self.lm_head.weight.copy_(rows.to(dtype))
            self.verifier_lm_head.weight.copy_(rows.to(dtype))
        if self.verifier_norm is None:
            return
        if norm_name not in weights:
            raise ValueError(
                f"{path} has no final norm {norm_name!r}; pass use_verifier_norm=False to score "
                "against the LM head alone (0.3.0's behaviour)"
            )
        norm = weights[norm_name]
        if norm.shape != self.verifier_norm.weight.shape:
            raise ValueError(
                f"verifier norm {tuple(norm.shape)} does not fit target_hidden_size "
                f"{self.target_hidden_size}"
            )
        eps = _rms_norm_eps(load_verifier_config_dict(path))
        if eps is not None:
            self.verifier_norm.variance_epsilon = eps
        with torch.no_grad():
            self.verifier_norm.weight.copy_(norm.to(self.verifier_norm.weight.dtype))

    def _materialize_frozen(self) -> None:
        """Give the frozen verifier copies real storage: `from_pretrained` leaves the ones a
        checkpoint does not hold (never saved) on the meta device."""
        device = self.lm_head.weight.device
        dtype = self.lm_head.weight.dtype
        for module in (self.verifier_lm_head, self.verifier_norm, self.embed_tokens):
            if module is not None and module.weight.is_meta:
                fresh = torch.ones(module.weight.shape, device=device, dtype=dtype)
                module.weight = nn.Parameter(fresh, requires_grad=False)

    @torch.no_grad()
    def target_logits(self, verifier_last_hidden_states: torch.Tensor) -> torch.Tensor:
        """The training targets over the draft vocabulary: the verifier's own logits.

        `verifier_last_hidden_states` is the verifier's last decoder layer output before its
        final norm (what datagen stores); the frozen norm and LM head rows turn it into logits.
        """
        if self.verifier_lm_head.weight.is_meta:
            raise ValueError(
                "the verifier's LM head is not loaded (checkpoints do not hold it); call "
                "load_verifier_weights() before training or scoring"
            )
        hidden = verifier_last_hidden_states
        if self.verifier_norm is not None:
            hidden = self.verifier_norm(hidden)
        return self.verifier_lm_head(hidden.to(self.verifier_lm_head.weight.dtype))

    def frozen_weights_to(self, dtype: torch.dtype) -> None:
        """Store the frozen verifier copies (embeddings, final norm, LM head) in `dtype`.

        They are never trained, so bf16 storage loses nothing that bf16 compute would keep.
        """
        for module in (self.embed_tokens, self.verifier_norm, self.verifier_lm_head):
            if module is not None:
                module.to(dtype)

    def resolved_attention_backend(self, device: torch.device) -> Literal["flex", "sdpa"]:
        """The attention path a forward on `device` takes."""
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(
                f"attention_backend must be 'auto', 'flex' or 'sdpa', got {self.attention_backend!r}"
            )
        if self.attention_backend == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return self.attention_backend

    def _compiling(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile_blocks is None else bool(self.compile_blocks)

    def _skipping_unscored_rows(self, device: torch.device) -> bool:
        if self.skip_unscored_rows is None:
            return device.type != "cpu"
        return bool(self.skip_unscored_rows)

    def _skipping_unused_positions(self, device: torch.device) -> bool:
        if self.skip_unused_positions is None:  # measured and tested on CUDA only
            return device.type == "cuda"
        return bool(self.skip_unused_positions)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        lengths: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        verifier_last_hidden_states: torch.Tensor | None = None,
        ttt_steps: int = 3,
        ttt_step_loss_decay: float = 1.0,
        use_off_policy_tokens: bool = False,
        output_logits: bool = False,
        **kwargs: Any,
    ) -> Eagle3DraftOutput:
        """Unroll `ttt_steps` draft steps over a packed row `[1, total_seq_len]`.

        `hidden_states` `[1, T, 3 * target_hidden]` are the fused auxiliary target states,
        `input_ids` `[1, T]` the tokens paired with them (the shifted batch: position i holds
        token x[i+1] beside the states of token i). Step 0 feeds `input_ids`; step k > 0 feeds
        the draft's own previous argmax (mapped through `d2t`), or with
        `use_off_policy_tokens=True` the ground truth: `input_ids[i + k]` at position i, i.e. the
        token x[i+k+1] that the chain started at i would have produced at step k - 1 had every
        earlier step been right (exact teacher forcing; zeros past the row's end, never scored).
        `output_logits=True` also returns every step's draft logits `[1, T, draft_vocab]`.
        With `skip_unused_positions`, draft tokens of positions nothing reads are -1.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"hidden_states must be [1, seq, 3*hidden], got {tuple(hidden_states.shape)}")
        device = hidden_states.device
        total = hidden_states.shape[1]
        if input_ids.shape != (1, total):
            raise ValueError(f"input_ids must be [1, {total}], got {tuple(input_ids.shape)}")
        backend = self.resolved_attention_backend(device)
        compiled = self._compiling(device)
        for layer in self.layers:
            layer.compile_blocks = compiled
        if lengths is None:
            lengths = torch.tensor([total], device=device)
        if position_ids is None:
            position_ids = torch.arange(1, total + 1, device=device).unsqueeze(0)
        # Flex rows are padded to whole blocks; padded positions see only themselves and are
        # never scored or returned.
        padded = -(-total // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE if backend == "flex" else total
        pad = padded - total
        if pad:
            hidden_states = F.pad(hidden_states, (0, 0, 0, pad))
            input_ids = F.pad(input_ids, (0, pad))
            position_ids = F.pad(position_ids.to(device), (0, pad))
        lengths = lengths.to(device)
        documents = document_ids(lengths, padded)
        mask = build_step_zero_mask(
            lengths, padded, flex=backend == "flex", device=device, documents=documents
        )
        cache = _StepKeyValues()
        hidden = self.fc(hidden_states)
        cast_dtype = autocast_dtype(device.type)
        compute_dtype = cast_dtype or hidden.dtype
        # Each weight is cast once per forward pass, at its first use; the TTT steps share it.
        layer_weights = FirstLayerWeightCache(cast_dtype)
        original_ids = input_ids
        scoring = verifier_last_hidden_states is not None
        # Per step, the positions the layer runs over (None: all) and why (`used_positions`).
        step_positions: list[torch.Tensor | None] = [None] * ttt_steps
        used_masks: list[torch.Tensor] = []
        used_counts: list[int] = []
        loss = None
        metrics: dict[str, torch.Tensor] | None = None
        if scoring:
            if verifier_last_hidden_states.shape[:2] != (1, total):
                raise ValueError(
                    f"verifier_last_hidden_states must be [1, {total}, hidden], got "
                    f"{tuple(verifier_last_hidden_states.shape)}"
                )
            # One row of targets per position plus `ttt_steps` spare rows, so that every step
            # reads an aligned [padded, vocab] view.
            spare = F.pad(verifier_last_hidden_states[0], (0, 0, 0, pad + ttt_steps))
            targets = self.target_logits(spare)
            del spare
            target_ids = targets.argmax(dim=-1)
            self.lm_head.mark_read()  # after the targets' matmul: a gather may overlap it
            head_compute = self.lm_head.weight.detach().to(compute_dtype)
            head_grad = (
                WeightGradSink()
                if torch.is_grad_enabled() and self.lm_head.weight.requires_grad
                else None
            )
            base_mask = torch.ones(padded + ttt_steps, dtype=torch.bool, device=device)
            if loss_mask is not None:
                base_mask[:total] = loss_mask[0].to(torch.bool)
            base_mask[total:] = False
            prev_correct = base_mask[:padded].clone()
            scored_masks = []
            for step in range(ttt_steps):
                scored = base_mask.clone()
                scored[:padded] &= _same_sample_as_target(documents, step)
                scored_masks.append(scored)
            scored_counts: list[int] | None = None
            if (
                self._skipping_unused_positions(device)
                and len(self.layers) == 1
                and not output_logits
            ):
                aligned = _aligned_masks(scored_masks, padded, total)
                used_masks = _used_from_aligned(aligned, prev_correct)
                # One host read before step 0's layer, which needs the first set; the targets'
                # matmul keeps the device busy meanwhile.
                counts = _counts(aligned + used_masks)
                scored_counts, used_counts = counts[:ttt_steps], counts[ttt_steps:]
                step_positions = [
                    torch.nonzero_static(used, size=count).squeeze(1)
                    if count <= MAX_USED_FRACTION_TO_SKIP * padded
                    else None
                    for used, count in zip(used_masks, used_counts, strict=True)
                ]
            loss = torch.zeros((), dtype=torch.float32, device=device)
            metrics = {}
        draft_tokens = []
        all_logits: list[torch.Tensor] | None = [] if output_logits else None
        for step in range(ttt_steps):
            with torch.no_grad():
                embeds = self.embed_tokens(input_ids)
            hidden = self.run_layers(
                embeds, hidden, position_ids, mask, cache, layer_weights,
                positions=step_positions[step], keys_everywhere=step == 0,
                **kwargs,
            )
            normed = maybe_compiled(_final_norm, compiled)(self, hidden, compute_dtype)[0]
            if all_logits is not None:
                all_logits.append(self.lm_head(normed[:total])[None])
            if scoring:
                last_step = step == ttt_steps - 1
                # The head's gradient goes through the last step's loss alone (`WeightGradSink`):
                # complete at the start of the backward pass, and reducible from there on.
                head_weight = self.lm_head.weight
                if last_step:
                    normed = self.lm_head.mark_read(normed)
                elif head_grad is not None:
                    head_weight = head_weight.detach()
                if scored_counts is None and self._skipping_unscored_rows(device):
                    # Read here, with step 0's layer queued: the device is busy meanwhile.
                    scored_counts = scored_position_counts(scored_masks, total)
                score = score_ttt_step(
                    normed, head_weight, targets, scored_masks[step], prev_correct, step,
                    ttt_step_loss_decay, valid_rows=total,
                    masked_denominator=loss_mask is not None,
                    chunk_size=self.loss_chunk_size, compiled=compiled,
                    head_compute=head_compute, weight_grad_sink=head_grad, target_ids=target_ids,
                    scored_rows=scored_counts[step] if scored_counts is not None else None,
                    used=used_masks[step] if used_masks else None,
                    used_rows=used_counts[step] if used_masks else None,
                )
                loss = loss + score.loss
                metrics[f"loss_{step}"] = score.loss.detach().clone()
                metrics[f"full_acc_{step}"] = score.full_acc
                metrics[f"cond_acc_{step}"] = score.cond_acc
                predicted = score.predicted[None]
            else:
                predicted = self._draft_argmax(normed)[None]
            draft_tokens.append(predicted[:, :total].detach().clone())
            if use_off_policy_tokens:
                shift = min(step + 1, padded)
                input_ids = torch.cat(
                    [original_ids[:, shift:], original_ids.new_zeros(1, shift)], dim=-1
                )
            else:
                fed = predicted.clamp(min=0)  # -1: a position no later step reads
                input_ids = fed + self.d2t[fed]
            mask = extend_mask_for_draft_tokens(mask)
            position_ids = position_ids + 1
        if scoring:
            metrics["loss"] = loss.detach().clone()
        return Eagle3DraftOutput(draft_tokens, loss, metrics, all_logits)

    def run_layers(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Any,
        cache: Any,
        weight_cache: FirstLayerWeightCache,
        positions: torch.Tensor | None = None,
        keys_everywhere: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One TTT step through the decoder layers: the first reads the token embeddings beside
        the hidden state, the later ones (if any) are plain Llama layers on the same cache.
        `positions` / `keys_everywhere`: see `LlamaDecoderEagle3FirstLayer.ttt_step` (one layer
        only)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        first_layer, *later_layers = self.layers
        if positions is not None and later_layers:
            raise ValueError("only a one-layer draft runs over a subset of positions")
        hidden = first_layer(
            hidden, input_embeds=embeds, attention_mask=mask,
            position_embeddings=position_embeddings, past_key_values=cache,
            weight_cache=weight_cache, positions=positions, keys_everywhere=keys_everywhere,
            **kwargs,
        )
        for layer in later_layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        return hidden

    @torch.no_grad()
    def _draft_argmax(self, normed: torch.Tensor) -> torch.Tensor:
        """Argmax of the draft logits, `loss_chunk_size` rows at a time."""
        self.lm_head.mark_read()
        weight = self.lm_head.weight.to(normed.dtype)
        return torch.cat(
            [(part @ weight.T).argmax(-1) for part in normed.split(self.loss_chunk_size)]
        )

    def incremental_proposer(self, count: int):
        """An `Eagle3Proposer`: the proposals of `propose_tokens`, batched over rows and run
        only over the positions accepted since the last round (the `hf` eval engine uses it)."""
        from speculators_vllm016.models.eagle3.proposer import Eagle3Proposer

        return Eagle3Proposer(self, count)

    @torch.no_grad()
    def propose_tokens(
        self, verifier_hidden_states: tuple[torch.Tensor, ...], tokens: torch.Tensor, count: int
    ) -> torch.Tensor:
        """Draft `count` tokens after `tokens` from the verifier's hidden states.

        `verifier_hidden_states` are transformers' `output_hidden_states` (entry i is the input of
        decoder layer i, as vLLM counts `eagle_aux_hidden_state_layer_ids`) for every position
        but the last; position t pairs the states of token t with token t + 1.
        """
        layer_ids = self.config.eagle_aux_hidden_state_layer_ids
        num_layers = len(verifier_hidden_states) - 1
        if not layer_ids:
            layer_ids = eagle3_aux_layer_ids(num_layers)  # vLLM's default for EAGLE-3
        fused = torch.cat([verifier_hidden_states[i] for i in layer_ids], dim=-1)
        length = fused.shape[1]
        shifted = tokens[:, 1 : length + 1]
        output = self(fused.to(self.fc.weight.dtype), shifted.to(fused.device), ttt_steps=count)
        draft_ids = torch.stack([step[0, -1] for step in output.draft_tokens])
        return draft_ids + self.d2t[draft_ids]
