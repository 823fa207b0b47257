"""Attention masks of EAGLE-3 training with test-time steps (TTT), over packed sequences.

Several samples are packed into one row (`lengths` gives their sizes). At TTT step 0 a position
sees the earlier positions of its own sample (causal, per document). Each later step appends one
draft token per position; a position then also sees its own draft tokens of the previous steps
(the diagonal of each appended block), and nothing of other positions' drafts.
Masks here are dense booleans `[q_len, kv_len]`, True where attention is allowed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "block_mask_to_dense_attention_mask",
    "create_combined_mask_mod",
    "extend_mask_for_draft_tokens",
]


def document_ids(lengths: torch.Tensor, total_seq_len: int) -> torch.Tensor:
    """`[total_seq_len]` sample index of every position; padding gets its own index."""
    lengths = lengths.to(torch.long)
    if int(lengths.sum()) > total_seq_len:
        raise ValueError(f"lengths sum to {int(lengths.sum())} > total_seq_len {total_seq_len}")
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    padding = total_seq_len - ids.numel()
    # Padding positions form their own document, so they never attend to real tokens.
    return torch.cat([ids, ids.new_full((padding,), len(lengths))])


def create_combined_mask_mod(lengths: torch.Tensor, total_seq_len: int) -> Callable:
    """`mask_mod(b, h, q_idx, kv_idx)` for step 0: causal within each packed sample.

    Key positions past `total_seq_len` belong to appended draft blocks: block `k` (from 1) at
    key `k * total_seq_len + j` is visible to query `q` only when `j == q`.
    """
    documents = document_ids(lengths, total_seq_len)

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // total_seq_len
        column = kv_idx % total_seq_len
        same_document = documents[q_idx] == documents[column]
        causal = (block == 0) & (column <= q_idx) & same_document
        own_draft = (block > 0) & (column == q_idx)
        return causal | own_draft

    return mask_mod


def block_mask_to_dense_attention_mask(
    block_mask: Callable | torch.Tensor, device: torch.device, dtype: torch.dtype,
    q_len: int | None = None, kv_len: int | None = None,
) -> torch.Tensor:
    """Additive float mask `[1, 1, q, kv]` (0 allowed, -inf masked) for eager/SDPA attention.

    Takes a dense boolean mask, or a `mask_mod` with its `q_len`/`kv_len`.
    """
    if callable(block_mask) and not isinstance(block_mask, torch.Tensor):
        if q_len is None or kv_len is None:
            raise ValueError("a mask_mod needs q_len and kv_len")
        q = torch.arange(q_len, device=device)[:, None]
        kv = torch.arange(kv_len, device=device)[None, :]
        allowed = block_mask(0, 0, q, kv)
    else:
        allowed = block_mask.to(device=device, dtype=torch.bool)
    bias = torch.zeros(allowed.shape, device=device, dtype=dtype)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias.view(1, 1, *allowed.shape[-2:])


def extend_mask_for_draft_tokens(block_mask: torch.Tensor) -> torch.Tensor:
    """The mask of the next TTT step: one more key block, visible only on its diagonal."""
    q_len = block_mask.shape[-2]
    diagonal = torch.eye(q_len, dtype=torch.bool, device=block_mask.device)
    diagonal = diagonal.expand(*block_mask.shape[:-2], q_len, q_len)
    return torch.cat([block_mask.to(torch.bool), diagonal], dim=-1)


def step_zero_mask(lengths: torch.Tensor, total_seq_len: int) -> torch.Tensor:
    """Dense boolean mask `[total, total]` of TTT step 0."""
    mask_mod = create_combined_mask_mod(lengths, total_seq_len)
    positions = torch.arange(total_seq_len, device=lengths.device)
    return mask_mod(0, 0, positions[:, None], positions[None, :])
