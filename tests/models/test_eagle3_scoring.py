"""EAGLE-3 scoring: a hand-computed TTT step, the fused loss against the plain one."""

from __future__ import annotations

import math

import pytest
import torch

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.models.eagle3.core import (
    compute_metrics,
    linear_kl_loss,
    loss_function,
    WeightGradSink,
    score_ttt_step,
    scored_position_counts,
)
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
from tests.models.test_eagle3 import DRAFT_VOCAB, batch, eagle3_config


def kl(p: tuple[float, float], q: tuple[float, float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_one_ttt_step_by_hand():
    """Issue 15.7: step k = 1 scores draft position i against target position i + 1."""
    q = [(0.8, 0.2), (0.2, 0.8), (0.6, 0.4), (0.3, 0.7)]  # draft distributions, positions 0-3
    p = [(0.9, 0.1), (0.7, 0.3), (0.4, 0.6), (0.1, 0.9), (0.2, 0.8), (0.6, 0.4)]  # targets 0-5
    hidden = torch.tensor(q).log()  # with an identity head, logits = log q
    targets = torch.tensor(p).log()
    scored = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)  # loss mask of target positions
    prev_correct = torch.tensor([True, True, True, False])
    score = score_ttt_step(
        hidden, torch.eye(2), targets, scored, prev_correct, ttt_step=1, ttt_step_loss_decay=0.5,
        valid_rows=4,
    )
    # pairs (0, 1) and (2, 3) are scored; (1, 2) is masked; position 3 has no target
    expected = 0.5 * (kl(p[1], q[0]) + kl(p[3], q[2])) / (2 + 1e-5)
    assert float(score.loss) == pytest.approx(expected, rel=1e-6)
    # argmax: draft 0, 1, 0 vs target 0, 1, 1 -> right, right, wrong; prev_correct [1, 1, 1]
    # hits among scored pairs: (0, 1) only -> full 1/2, conditional 1/3
    assert float(score.full_acc) == pytest.approx(1 / 2, rel=1e-4)
    assert float(score.cond_acc) == pytest.approx(1 / 3, rel=1e-4)
    assert prev_correct.tolist() == [True, True, False, False]
    assert score.predicted.tolist() == [0, 1, 0, 1]


def test_fused_loss_and_gradients_equal_the_plain_computation():
    torch.manual_seed(0)
    hidden = torch.randn(7, 5, requires_grad=True)
    weight = torch.randn(11, 5, requires_grad=True)
    targets = torch.randn(7, 11)
    row_weights = torch.rand(7)
    fused, predicted = linear_kl_loss(hidden, weight, targets, row_weights, chunk_size=3)
    (fused * 2.5).backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    plain = (torch.nn.functional.kl_div(
        logits.log_softmax(-1), targets.softmax(-1), reduction="none"
    ).sum(-1) * row_weights).sum()
    (plain * 2.5).backward()
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(fused_grads[0], hidden.grad)
    torch.testing.assert_close(fused_grads[1], weight.grad)
    assert torch.equal(predicted, logits.argmax(-1))


@pytest.mark.parametrize("sink", [False, True], ids=["own-gradient", "shared-sink"])
def test_skipping_unscored_rows_changes_nothing(sink):
    """With `scored_rows` the gradient matmuls run over the scored rows only: same loss,
    gradients and argmax (unscored rows included) as over every row."""
    torch.manual_seed(0)
    hidden = torch.randn(11, 5, requires_grad=True)
    weight = torch.randn(13, 5, requires_grad=True)
    targets = torch.randn(11, 13)
    scored = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    row_weights = torch.rand(11) * scored

    results = []
    for scored_rows in (None, int(scored.sum())):
        hidden.grad = weight.grad = None
        shared = WeightGradSink() if sink else None
        loss, predicted = linear_kl_loss(
            hidden, weight, targets, row_weights, chunk_size=2, weight_grad_sink=shared,
            scored_rows=scored_rows,
        )
        (loss * 1.5).backward()
        results.append((loss.detach(), predicted, hidden.grad.clone(), weight.grad.clone()))
    loss_all, predicted_all, hidden_all, weight_all = results[0]
    loss_few, predicted_few, hidden_few, weight_few = results[1]
    torch.testing.assert_close(loss_few, loss_all)
    assert torch.equal(predicted_few, predicted_all)
    assert torch.equal(predicted_all, (hidden @ weight.T).argmax(-1))
    torch.testing.assert_close(hidden_few, hidden_all)
    assert torch.all(hidden_few[~scored] == 0)
    torch.testing.assert_close(weight_few, weight_all)


def test_scored_position_counts_count_what_each_step_scores():
    scored = [torch.tensor([1, 1, 0, 1, 0], dtype=torch.bool), torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)]
    # step 0 reads positions 0..3 (valid rows 4), step 1 positions 1..3
    assert scored_position_counts(scored, valid_rows=4) == [3, 3]
    assert scored_position_counts(scored, valid_rows=1) == [1, 0]


def test_forward_metrics_equal_the_030_functions(tiny_llama):
    """The forward's fused scoring gives what 0.3.0's compute_metrics gives on its logits."""
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mappings_from_distribution({t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512)
    model = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    data = batch(20, seed=6)
    out = model(**data, ttt_steps=3, ttt_step_loss_decay=0.8, output_logits=True)
    targets = model.target_logits(data["verifier_last_hidden_states"])
    prev_correct = data["loss_mask"].clone().bool()
    total = torch.zeros(())
    for step in range(3):
        loss, metrics = compute_metrics(
            out.logits[step], targets, data["loss_mask"], prev_correct, step, 0.8
        )
        total = total + loss
        for name in ("loss", "full_acc", "cond_acc"):
            torch.testing.assert_close(out.metrics[f"{name}_{step}"], metrics[f"{name}_{step}"],
                                       rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, total, rtol=1e-5, atol=1e-6)
    # gradients too: the fused loss against 0.3.0's loss_function on the returned logits
    out.loss.backward()
    fused = model.lm_head.weight.grad.clone()
    model.zero_grad()
    again = model(**data, ttt_steps=3, ttt_step_loss_decay=0.8, output_logits=True)
    plain = torch.zeros(())
    for step in range(3):
        logits, aligned = again.logits[step][:, : 20 - step], targets[:, step:]
        plain = plain + 0.8**step * loss_function(logits, aligned, data["loss_mask"][:, step:])
    plain.backward()
    torch.testing.assert_close(fused, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_skipping_unscored_rows_in_the_forward_changes_nothing(tiny_llama):
    """`skip_unscored_rows` (on by default on accelerators) against the full-row loss, on a CPU:
    same loss, metrics, draft tokens and gradients."""
    d2t, t2d = build_vocab_mappings_from_distribution({t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512)
    model = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    assert not model._skipping_unscored_rows(torch.device("cpu"))
    assert model._skipping_unscored_rows(torch.device("cuda"))
    data = batch(20, seed=6)
    assert 0 < int(data["loss_mask"].sum()) < 20  # some rows are skipped
    runs = []
    for skip in (False, True):
        model.skip_unscored_rows = skip
        model.zero_grad(set_to_none=True)
        out = model(**data, ttt_steps=3, ttt_step_loss_decay=0.8)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        runs.append((out, grads))
    (full, full_grads), (skipped, skipped_grads) = runs
    torch.testing.assert_close(skipped.loss, full.loss)
    for name, value in full.metrics.items():
        torch.testing.assert_close(skipped.metrics[name], value, msg=name)
    for mine, theirs in zip(skipped.draft_tokens, full.draft_tokens, strict=True):
        assert torch.equal(mine, theirs)
    assert skipped_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(skipped_grads[name], grad, msg=name)
