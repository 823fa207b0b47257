"""EAGLE-3 scoring: a hand-computed TTT step, the fused loss against the plain one."""

from __future__ import annotations

import math

import pytest
import torch

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.models.eagle3.core import compute_metrics, loss_function
from speculators_vllm016.models.eagle3.fused_loss import WeightGradSink, linear_kl_loss
from speculators_vllm016.models.eagle3.scoring import (
    TTTStepInput,
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
        TTTStepInput(
            hidden,
            torch.eye(2),
            targets,
            scored,
            prev_correct,
            ttt_step=1,
            ttt_step_loss_decay=0.5,
            valid_rows=4,
        )
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
    plain = (
        torch.nn.functional.kl_div(
            logits.log_softmax(-1), targets.softmax(-1), reduction="none"
        ).sum(-1)
        * row_weights
    ).sum()
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
            hidden,
            weight,
            targets,
            row_weights,
            chunk_size=2,
            weight_grad_sink=shared,
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
    scored = [
        torch.tensor([1, 1, 0, 1, 0], dtype=torch.bool),
        torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool),
    ]
    # step 0 reads positions 0..3 (valid rows 4), step 1 positions 1..3
    assert scored_position_counts(scored, valid_rows=4) == [3, 3]
    assert scored_position_counts(scored, valid_rows=1) == [1, 0]


def test_forward_metrics_equal_the_030_functions(tiny_llama):
    """The forward's fused scoring gives what 0.3.0's compute_metrics gives on its logits."""
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512
    )
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
            torch.testing.assert_close(
                out.metrics[f"{name}_{step}"], metrics[f"{name}_{step}"], rtol=1e-5, atol=1e-6
            )
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
    d2t, t2d = build_vocab_mappings_from_distribution(
        {t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512
    )
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


def test_used_positions_by_hand():
    """Step k's output at i is read where a step >= k scores i, and before the last step also
    where the loss mask (the conditional accuracies' seed) holds."""
    from speculators_vllm016.models.eagle3.scoring import used_positions

    # target positions 0-7 (+2 spare), one sample of 7 real positions; masks indexed by target
    loss_mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    scored = [loss_mask.clone() for _ in range(3)]
    seed = loss_mask[:8].clone()
    used = used_positions(scored, seed, valid_rows=7)
    # step 2 scores i where loss_mask[i + 2], i < 5: positions 0, 3, 4
    assert used[2].tolist() == [True, False, False, True, True, False, False, False]
    # step 1: scored i + 1 (i < 6): 0, 1, 4, 5; or later (0, 3, 4); or the seed (1, 2, 5, 6)
    assert used[1].tolist() == [True, True, True, True, True, True, True, False]
    assert used[0].tolist() == used[1].tolist()


def _one_step(model, data, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**data, ttt_steps=3, ttt_step_loss_decay=0.8, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_skipping_unused_positions_changes_no_loss_metric_or_gradient(
    tiny_llama, backend, norm_before_residual
):
    """`skip_unused_positions` (the trainer's choice on accelerators) against every position run:
    same loss, metrics and gradients; the same draft tokens where anything reads them, -1 at
    the others. Three samples, prompts masked in spans as chat data is."""
    from speculators_vllm016.models.eagle3.scoring import used_positions

    d2t, t2d = build_vocab_mappings_from_distribution(
        {t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512
    )
    config = eagle3_config(str(tiny_llama))
    config.norm_before_residual = norm_before_residual
    model = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
    model.attention_backend = backend
    model.compile_blocks = False
    data = batch(40, seed=11)
    data["lengths"] = torch.tensor([15, 17, 8])
    spans = torch.zeros(1, 40, dtype=torch.long)
    for start, end in ((4, 12), (19, 30), (33, 37)):  # assistant turns
        spans[0, start:end] = 1
    data["loss_mask"] = spans
    assert model.skip_unused_positions is False  # 0.3.0's outputs by default
    model.skip_unused_positions = None  # the trainer's choice: on CUDA only
    assert model._skipping_unused_positions(torch.device("cuda"))
    assert not model._skipping_unused_positions(torch.device("cpu"))
    model.skip_unused_positions = False
    full, full_grads = _one_step(model, data)
    model.skip_unused_positions = True
    layer_outputs = []
    hook = model.layers[0].register_forward_hook(
        lambda module, args, out: layer_outputs.append(out.detach())
    )
    try:
        skipped, skipped_grads = _one_step(model, data)
    finally:
        hook.remove()
    torch.testing.assert_close(skipped.loss, full.loss)
    for name, value in full.metrics.items():
        torch.testing.assert_close(skipped.metrics[name], value, msg=name)
    assert skipped_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(skipped_grads[name], grad, msg=name)
    documents = torch.repeat_interleave(torch.arange(3), data["lengths"])
    scored = []
    for step in range(3):
        same = torch.zeros(43, dtype=torch.bool)  # indexed by target position j = i + step
        same[step:40] = documents[step:] == documents[: 40 - step]
        scored.append(torch.cat([spans[0].bool(), torch.zeros(3, dtype=torch.bool)]) & same)
    used = used_positions(scored, spans[0].bool(), valid_rows=40)
    for step, (mine, theirs) in enumerate(
        zip(skipped.draft_tokens, full.draft_tokens, strict=True)
    ):
        assert 0 < int(used[step].sum()) < 40
        output = layer_outputs[step][0, :40]  # the layer ran over the used positions alone
        assert bool((output[~used[step]] == 0).all()) and bool(
            output[used[step]].abs().sum(-1).gt(0).all()
        )
        assert torch.equal(mine[0, used[step]], theirs[0, used[step]]), step
        assert bool((mine[0, ~used[step]] == -1).all()), step


def test_skipping_unused_positions_keeps_accuracies_when_the_draft_is_right(tiny_llama):
    """The conditional accuracies count the earlier hits of loss-masked positions that a later
    step does not score: with a draft that is right at about half the positions (all its logits
    zero, so it always picks draft id 0, against targets whose argmax is 0 where chosen), the
    metrics of the skipping forward equal the full one's."""
    d2t, t2d = build_vocab_mappings_from_distribution(
        {t: 1 for t in range(DRAFT_VOCAB)}, DRAFT_VOCAB, 512
    )
    model = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    model.compile_blocks = False
    with torch.no_grad():
        model.norm.weight.zero_()  # normed states are 0: every logit 0, the argmax draft id 0
    data = batch(40, seed=12)
    data["lengths"] = torch.tensor([22, 18])
    spans = torch.zeros(1, 40, dtype=torch.long)
    spans[0, 3:13] = spans[0, 25:36] = 1
    data["loss_mask"] = spans
    towards_zero = model.verifier_lm_head.weight[0] / model.verifier_norm.weight
    hits = torch.rand(40, generator=torch.Generator().manual_seed(3)) < 0.6
    data["verifier_last_hidden_states"] = torch.where(
        hits[None, :, None],
        towards_zero.detach().expand(1, 40, -1),
        data["verifier_last_hidden_states"],
    )
    assert bool(
        (model.target_logits(data["verifier_last_hidden_states"][0]).argmax(-1)[hits] == 0).all()
    )
    outputs = []
    for skip in (False, True):
        model.skip_unused_positions = skip
        outputs.append(model(**data, ttt_steps=3))
    full, skipped = outputs
    assert float(full.metrics["cond_acc_2"]) > 0
    for name, value in full.metrics.items():
        torch.testing.assert_close(skipped.metrics[name], value, msg=name)
