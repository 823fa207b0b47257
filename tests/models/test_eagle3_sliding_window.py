"""Sliding-window draft attention in training: each TTT step's mask keeps exactly the keys vLLM
0.16 lets the served draft see (a query at position p sees keys at p - W + 1 .. p), in the flex
block form and the dense form alike."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from speculators_vllm016.models.eagle3.attention import (
    FLEX_BLOCK_SIZE,
    build_step_zero_mask,
    document_ids,
    step_mask,
)
from speculators_vllm016.models.eagle3.config import sliding_window_of
from speculators_vllm016.utils.errors import InvalidInputError

# Two packed samples (the first fills four whole blocks: full blocks exist), then padding.
LENGTHS = torch.tensor([600, 150])
TOTAL = 896


def _served(documents: torch.Tensor, step: int, window: int) -> torch.Tensor:
    """What vLLM's draft sees at TTT step `step`, written from positions: the query of row
    position i stands at i + step; step-0 key c at c; a later step's key of i is i's own."""
    total = documents.numel()
    i = torch.arange(total)[:, None]
    c = torch.arange(total)[None, :]
    same = (documents[:, None] == documents[None, :]) & (documents[:, None] >= 0)
    context = same & (c <= i) & ((i + step) - c < window)
    own = c == i
    return torch.cat([context | own] + [own] * step, dim=1)


def _dense_from_blocks(mask, expected: torch.Tensor) -> torch.Tensor:
    """A flex `BlockMask` as flex attention reads it: listed partial blocks through its
    mask_mod, listed full blocks whole, the rest empty. Also checks that it lists no block with
    nothing to see (a window's work grows with the window, not the row)."""
    q_len, kv_len = mask.seq_lengths
    size = FLEX_BLOCK_SIZE
    by_mod = mask.mask_mod(0, 0, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for q_block in range(q_len // size):
        rows = slice(q_block * size, (q_block + 1) * size)
        count = int(mask.kv_num_blocks[0, 0, q_block])
        for k_block in mask.kv_indices[0, 0, q_block, :count].tolist():
            cols = slice(k_block * size, (k_block + 1) * size)
            out[rows, cols] = by_mod[rows, cols]
            assert expected[rows, cols].any(), f"block ({q_block}, {k_block}) listed, all masked"
        if mask.full_kv_num_blocks is not None:
            count = int(mask.full_kv_num_blocks[0, 0, q_block])
            for k_block in mask.full_kv_indices[0, 0, q_block, :count].tolist():
                out[rows, k_block * size : (k_block + 1) * size] = True
    return out


@pytest.mark.parametrize("window", [3, 70, 129, 300, 10_000])
def test_every_steps_mask_is_the_window_vllm_serves(window):
    documents = document_ids(LENGTHS, TOTAL)
    for step in range(3):
        expected = _served(documents, step, window)
        dense = step_mask(documents, step, flex=False, window=window)
        flex = step_mask(documents, step, flex=True, window=window)
        assert torch.equal(dense[0, 0], expected), (window, step)
        assert torch.equal(_dense_from_blocks(flex, expected), expected), (window, step)
    zero = build_step_zero_mask(LENGTHS, TOTAL, flex=True, window=window)
    expected = _served(documents, 0, window)
    assert torch.equal(_dense_from_blocks(zero, expected), expected)


def test_a_window_too_short_for_the_step_is_refused():
    documents = document_ids(LENGTHS, TOTAL)
    with pytest.raises(InvalidInputError, match="sliding window of 2"):
        step_mask(documents, 2, flex=False, window=2)


def test_the_window_is_read_as_vllm_reads_it():
    def layer(**extra):
        return LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, **extra)

    assert sliding_window_of(layer()) is None
    assert sliding_window_of(layer(layer_types=["full_attention"] * 2, sliding_window=8)) is None
    sliding = layer(layer_types=["sliding_attention"] * 2, sliding_window=8)
    assert sliding_window_of(sliding) == 8
    for bad in (["sliding_attention", "full_attention"], ["sliding_attention"] * 2):
        with pytest.raises(InvalidInputError, match="layer_types"):
            sliding_window_of(
                layer(layer_types=bad, sliding_window=None if len(set(bad)) == 1 else 8)
            )
