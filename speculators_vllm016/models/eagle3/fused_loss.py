"""The fused KL loss of a linear head: `linear_kl_loss` and its autograd kernel `_LinearKL`.

`sum_i w_i KL(softmax(t_i) || softmax(h_i W^T))` without ever holding the `[rows, vocab]`
logits: they exist one chunk of rows at a time, and their gradients w.r.t. the hidden states and
the head are formed in the forward pass. `WeightGradSink` lets the TTT steps of one forward pass,
which share the head, build one head gradient. The eager reference is `metrics.loss_function`.
"""

from __future__ import annotations

from typing import Any

import torch

from speculators_vllm016.models.eagle3.model_definitions import maybe_compiled
from speculators_vllm016.models.eagle3.symbolic_dims import compile_symbolic
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["WeightGradSink", "linear_kl_loss"]


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


def _mark_chunk_rows(args: tuple[Any, ...]) -> None:
    """A KL block's chunk row count symbolic: dim 0 of the first argument, and of every other
    argument of that length.

    Every chunk of a step but the last has `chunk_size` rows, the last fewer. Compiled for the
    first chunk's fixed count, the last chunk compiled the block again (1.6-1.8 s of a cold
    first step on an H100 at the Kimi-K2.5 draft's shapes). The block works row by row (a
    softmax per row) except for the loss, one sum over the chunk's rows whose order a symbolic
    kernel may choose otherwise: the gradients and the argmax keep their bits, the loss can
    change in its last ones.
    """
    rows = args[0].shape[0]
    for tensor in args:
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[0] == rows:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


compile_symbolic(_kl_chunk, _mark_chunk_rows)
compile_symbolic(_kl_rows, _mark_chunk_rows)


def _accumulate_product(
    total: torch.Tensor, left: torch.Tensor, right: torch.Tensor
) -> torch.Tensor:
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
                raise InvalidInputError(
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
        ctx,
        hidden,
        weight,
        weight_compute,
        targets,
        row_weights,
        chunk_size,
        compiled,
        sink,
        scored_rows,
        used,
        used_rows,
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
        raise InvalidInputError("`used` needs its count `used_rows` and `scored_rows`")
    return _LinearKL.apply(
        hidden,
        weight,
        weight_compute,
        target_logits,
        row_weights,
        chunk_size,
        compiled,
        weight_grad_sink,
        scored_rows,
        used,
        used_rows,
    )
