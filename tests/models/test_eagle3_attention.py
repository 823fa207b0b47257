"""EAGLE-3 attention: block masks and their TTT extension, flex vs SDPA, packed samples."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.models.eagle3.attention import (
    ATTENTION_INTERFACE_NAME,
    block_mask_to_dense_attention_mask,
    build_step_zero_mask,
    create_combined_mask_mod,
    document_block_mask,
    document_ids,
    extend_mask_for_draft_tokens,
    flex_attention_forward,
)
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
from tests.models.test_eagle3 import DRAFT_VOCAB, batch, eagle3_config

LENGTHS = torch.tensor([100, 60, 50])  # 210 real positions in a row of 256: 46 padding


def reference_mask(lengths: list[int], total: int, steps: int) -> torch.Tensor:
    """The mask written out position by position (True = may attend)."""
    owner = [doc for doc, n in enumerate(lengths) for _ in range(n)]
    owner += [-1] * (total - len(owner))
    mask = torch.zeros(total, steps * total, dtype=torch.bool)
    for q in range(total):
        for kv in range(q + 1):
            if owner[q] >= 0 and owner[q] == owner[kv]:
                mask[q, kv] = True
        for step in range(steps):
            mask[q, step * total + q] = True
    return mask


@pytest.mark.parametrize(
    "lengths, total",
    [([100, 60, 50], 256), ([3, 0, 2], 5), ([0, 4], 7), ([], 3), ([8], 8)],
)
def test_document_ids_number_the_samples_and_mark_padding(lengths, total):
    owner = [doc for doc, n in enumerate(lengths) for _ in range(n)]
    owner += [-1] * (total - len(owner))
    ids = document_ids(torch.tensor(lengths, dtype=torch.long), total)
    assert ids.tolist() == owner


def test_document_ids_refuse_lengths_longer_than_the_row():
    with pytest.raises(ValueError, match="sum past total_seq_len 6"):
        document_ids(torch.tensor([3, 4]), 6)


def test_block_mask_matches_the_written_out_mask_at_every_step():
    mask = build_step_zero_mask(LENGTHS, 256, flex=True)
    assert isinstance(mask, BlockMask)
    for steps in (1, 2, 3):
        dense = block_mask_to_dense_attention_mask(mask, torch.device("cpu"), torch.bool)
        assert dense.shape == (1, 1, 256, 256 * steps)
        assert torch.equal(dense[0, 0], reference_mask(LENGTHS.tolist(), 256, steps)), steps
        ones = block_mask_to_dense_attention_mask(mask, torch.device("cpu"), torch.float32)
        assert set(ones.unique().tolist()) == {0.0, 1.0}
        mask = extend_mask_for_draft_tokens(mask)
        assert isinstance(mask, BlockMask)
    # the dense form of the same masks agrees
    dense = build_step_zero_mask(LENGTHS, 256, flex=False)
    dense = extend_mask_for_draft_tokens(extend_mask_for_draft_tokens(dense))
    assert torch.equal(dense[0, 0], reference_mask(LENGTHS.tolist(), 256, 3))


BLOCK_MASK_PARTS = (
    ("kv_num_blocks", "kv_indices"),
    ("full_kv_num_blocks", "full_kv_indices"),
    ("q_num_blocks", "q_indices"),
    ("full_q_num_blocks", "full_q_indices"),
)


@pytest.mark.parametrize(
    "lengths, total",
    [
        ([100, 60, 50], 256),  # padding inside the last block
        ([128, 128, 256], 512),  # samples on block boundaries: full blocks
        ([300, 5, 0, 200], 640),  # a sample of no tokens, samples over several blocks
        ([640], 640),  # one sample, no padding
        ([1, 1, 126, 130], 512),  # a block of padding alone
        ([], 256),  # no samples
    ],
)
def test_block_mask_read_off_the_sample_ids_lists_the_blocks_flex_finds(lengths, total):
    """`create_block_mask` evaluates the mask at every position (compiled on a GPU: minutes of
    kernel builds at 16k tokens); ours never evaluates it and must list the same blocks."""
    lengths = torch.tensor(lengths, dtype=torch.long)
    documents = document_ids(lengths, total)
    expected = create_block_mask(
        create_combined_mask_mod(lengths, total, documents),
        None,
        None,
        total,
        total,
        device="cpu",
        BLOCK_SIZE=128,
    )

    def never(*_):
        raise AssertionError("the mask was evaluated position by position")

    mine = document_block_mask(documents, never)
    assert mine.seq_lengths == (total, total)
    for counts, indices in BLOCK_MASK_PARTS:
        assert torch.equal(getattr(mine, counts), getattr(expected, counts)), counts
        for row, count in enumerate(getattr(expected, counts)[0, 0].tolist()):
            listed = getattr(mine, indices)[0, 0, row, :count]
            assert listed.tolist() == getattr(expected, indices)[0, 0, row, :count].tolist(), (
                indices
            )


def test_extended_block_mask_has_the_new_blocks_where_flex_reads_them():
    """Flex only visits the blocks the BlockMask lists: its output must equal dense SDPA's."""
    torch.manual_seed(0)
    mask = build_step_zero_mask(LENGTHS, 256, flex=True)
    for _ in range(2):
        mask = extend_mask_for_draft_tokens(mask)
    kv_len = 3 * 256
    query = torch.randn(1, 4, 256, 16)
    key, value = torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)
    flex_out, weights = flex_attention_forward(None, query, key, value, mask, scaling=0.25)
    assert weights is None and flex_out.shape == (1, 256, 4, 16)
    dense = block_mask_to_dense_attention_mask(mask, query.device, torch.bool)
    sdpa_out, _ = flex_attention_forward(None, query, key, value, dense, scaling=0.25)
    torch.testing.assert_close(flex_out, sdpa_out, rtol=1e-4, atol=1e-5)
    block_level = mask.to_dense()[0, 0]
    assert block_level.shape == (2, 6)
    assert block_level[:, 2:].tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]


def test_combined_mask_mod_broadcasts_and_registers():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mod = create_combined_mask_mod(torch.tensor([2, 1]), 4)
    q = torch.arange(4)[:, None]
    kv = torch.arange(8)[None, :]
    assert mod(0, 0, q, kv).tolist() == [
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 1, 0, 0, 0, 1, 0],
        [0, 0, 0, 1, 0, 0, 0, 1],
    ]
    assert ALL_ATTENTION_FUNCTIONS[ATTENTION_INTERFACE_NAME] is flex_attention_forward
    with pytest.raises(ValueError, match="multiple of 128"):
        build_step_zero_mask(torch.tensor([5]), 100, flex=True)


@pytest.fixture(scope="module")
def draft(tiny_llama) -> Eagle3DraftModel:
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, DRAFT_VOCAB, 512
    )
    model = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    # a trained-looking head: sharper logits make argmax ties impossible
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


SAMPLES = (9, 14, 6)


def _samples():
    return [batch(n, seed=10 + i) for i, n in enumerate(SAMPLES)]


def _packed(samples):
    keys = ("hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask")
    packed = {key: torch.cat([s[key] for s in samples], dim=1) for key in keys}
    packed["loss_mask"] = torch.ones_like(packed["loss_mask"])  # cross pairs would count
    packed["lengths"] = torch.tensor(SAMPLES)
    packed["position_ids"] = torch.cat([torch.arange(1, n + 1) for n in SAMPLES])[None]
    return packed


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_every_packed_sample_equals_its_run_alone(draft, backend):
    """Issue 15.6: logits of every sample, every TTT step, packed vs alone; and the packed
    loss of each step is exactly the samples' own losses combined (no pair across samples)."""
    draft.attention_backend = backend
    steps = 3
    try:
        samples = _samples()
        with torch.no_grad():
            together = draft(**_packed(samples), ttt_steps=steps, output_logits=True)
            alone = [
                draft(
                    **{**s, "loss_mask": torch.ones_like(s["loss_mask"])},
                    ttt_steps=steps,
                    output_logits=True,
                )
                for s in samples
            ]
    finally:
        draft.attention_backend = "auto"
    start = 0
    for index, (n, single) in enumerate(zip(SAMPLES, alone, strict=True)):
        for step in range(steps):
            torch.testing.assert_close(
                together.logits[step][:, start : start + n],
                single.logits[step],
                rtol=1e-4,
                atol=1e-4,
                msg=f"sample {index} step {step}",
            )
            assert torch.equal(
                together.draft_tokens[step][:, start : start + n], single.draft_tokens[step]
            ), (index, step)
        start += n
    for step in range(steps):
        # sample j contributes n_j - step scored positions at step `step`
        counts = [n - step for n in SAMPLES]
        combined = sum(
            float(s.metrics[f"loss_{step}"]) * c for s, c in zip(alone, counts, strict=True)
        )
        expected = combined / sum(counts)
        assert float(together.metrics[f"loss_{step}"]) == pytest.approx(expected, rel=1e-4), step


def test_a_row_padded_to_the_run_length_trains_as_the_row_itself(draft):
    """`flex_row_length` (the trainer's --total-seq-len) pads a short row: same loss, gradients
    and draft tokens as the row unpadded (the padding sees only itself, nothing scores it)."""
    data = {**batch(200, seed=4), "lengths": torch.tensor([120, 80])}
    draft.attention_backend = "flex"
    results = {}
    try:
        for pad_to in (None, 384):
            draft.flex_row_length = pad_to
            draft.zero_grad(set_to_none=True)
            out = draft(**data, ttt_steps=3)
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
            results[pad_to] = (out, grads)
    finally:
        draft.attention_backend, draft.flex_row_length = "auto", None
        draft.zero_grad(set_to_none=True)
    (plain, plain_grads), (padded, padded_grads) = results[None], results[384]
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-5, atol=1e-6)
    assert padded_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for step in range(3):
        assert padded.draft_tokens[step].shape == (1, 200)
        assert torch.equal(padded.draft_tokens[step], plain.draft_tokens[step])


def test_flex_and_sdpa_paths_agree(draft):
    data = batch(40, seed=3)
    results = {}
    for backend in ("sdpa", "flex"):
        draft.attention_backend = backend
        try:
            results[backend] = draft(**data, lengths=torch.tensor([25, 15]), ttt_steps=3)
        finally:
            draft.attention_backend = "auto"
    torch.testing.assert_close(results["flex"].loss, results["sdpa"].loss, rtol=1e-4, atol=1e-5)
    for step in range(3):
        assert torch.equal(results["flex"].draft_tokens[step], results["sdpa"].draft_tokens[step])
    with pytest.raises(ValueError, match="attention_backend"):
        draft.attention_backend = "fast"
        try:
            draft(**data)
        finally:
            draft.attention_backend = "auto"
