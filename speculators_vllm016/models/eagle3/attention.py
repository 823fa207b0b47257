"""Attention masks of EAGLE-3 training with test-time steps (TTT), over packed sequences.

Several samples are packed into one row (`lengths` gives their sizes). At TTT step 0 a position
sees the earlier positions of its own sample (causal, per document). Each later step appends one
block of `total_seq_len` draft keys; a position then also sees its own draft keys of the earlier
steps (the diagonal of each appended block), and nothing of other positions' drafts. Padding
positions (past `sum(lengths)`) see only themselves.

Two forms of the same mask: a flex-attention `BlockMask` (read off the sample ids block by
block, extended by one block column per step without evaluating the mask again), or a dense
boolean tensor for SDPA.
`flex_attention_forward` is a transformers attention-interface function that takes either.

Sliding-window drafts (`layer_types: ["sliding_attention"]` and `sliding_window` W in the layer
config, as vLLM 0.16's `Eagle3LlamaForCausalLM` reads them): vLLM lets a query at position p see
the keys at positions p - W + 1 .. p. At TTT step j the query of row position i stands at position
i + j, and its step-0 keys at their own positions, so it sees step-0 key c when i - c < W - j
(`step_mask`); its own draft keys of the earlier steps are fewer than W positions back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from speculators_vllm016.models.eagle3.model_definitions import maybe_compiled
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "ATTENTION_INTERFACE_NAME",
    "block_mask_to_dense_attention_mask",
    "build_step_zero_mask",
    "compiled_flex",
    "create_combined_mask_mod",
    "document_block_mask",
    "document_ids",
    "extend_mask_for_draft_tokens",
    "flex_attention_forward",
    "key_capacity",
    "padded_to_capacity",
    "step_mask",
]

# The name 0.3.0 registered its flex attention function under in transformers' registry.
ATTENTION_INTERFACE_NAME = "simple_flex_attention"
# Flex attention's block size; rows of the flex path are padded to a multiple of it so that
# each appended draft block starts on a block boundary.
FLEX_BLOCK_SIZE = 128


def document_ids(lengths: torch.Tensor, total_seq_len: int) -> torch.Tensor:
    """`[total_seq_len]` sample index of every position; padding positions get -1.

    Nothing here waits for the device: the training step's first kernels are queued while the
    previous step still runs. Lengths that sum past `total_seq_len` raise on a CPU and fail a
    device-side assertion elsewhere.
    """
    lengths = lengths.to(torch.long)
    ends = lengths.cumsum(0)
    used = ends[-1] if lengths.numel() else torch.zeros((), dtype=torch.long, device=lengths.device)
    message = f"lengths of the packed samples sum past total_seq_len {total_seq_len}"
    if lengths.device.type == "cpu":
        if int(used) > total_seq_len:
            raise InvalidInputError(
                f"{message} ({int(used)}); pass the lengths of the samples packed in this row"
            )
    else:
        torch._assert_async(used <= total_seq_len, message)
    positions = torch.arange(total_seq_len, device=lengths.device)
    ids = torch.searchsorted(ends, positions, right=True)
    return torch.where(positions < used, ids, -1)


def create_combined_mask_mod(
    lengths: torch.Tensor | None,
    total_seq_len: int,
    documents: torch.Tensor | None = None,
    window: int | None = None,
) -> Callable:
    """`mask_mod(b, h, q_idx, kv_idx)` of every TTT step (broadcasting index tensors).

    Key `kv_idx` belongs to step `kv_idx // total_seq_len`, position `kv_idx % total_seq_len`.
    Step 0 keys: causal within the query's own sample (padding sees nothing there but itself),
    and fewer than `window` positions back when given; later steps' keys: only the query's own
    position. `documents`: `document_ids(lengths, total_seq_len)` where the caller has them.
    """
    if documents is None:
        if lengths is None:
            raise InvalidInputError("pass the packed samples' lengths or their document ids")
        documents = document_ids(lengths, total_seq_len)

    def mask_mod(b, h, q_idx, kv_idx):
        column = kv_idx % total_seq_len
        own_position = column == q_idx
        same_sample = (documents[q_idx] == documents[column]) & (documents[q_idx] >= 0)
        causal = (kv_idx < total_seq_len) & (column <= q_idx) & same_sample
        if window is not None:
            causal = causal & (q_idx - column < window)
        return causal | own_position

    return mask_mod


def build_step_zero_mask(
    lengths: torch.Tensor,
    total_seq_len: int,
    *,
    flex: bool,
    device: torch.device | None = None,
    documents: torch.Tensor | None = None,
    window: int | None = None,
) -> BlockMask | torch.Tensor:
    """Step 0's mask: a `BlockMask` (`flex=True`; `total_seq_len` must be a multiple of 128) or a
    dense boolean `[1, 1, T, T]` tensor. `documents`, `window` as in `create_combined_mask_mod`."""
    device = device or lengths.device
    if flex and total_seq_len % FLEX_BLOCK_SIZE:
        raise InvalidInputError(
            f"flex masks need a row length that is a multiple of {FLEX_BLOCK_SIZE}, got "
            f"{total_seq_len}; pad the row"
        )
    lengths = lengths.to(device)
    documents = document_ids(lengths, total_seq_len) if documents is None else documents.to(device)
    mask_mod = create_combined_mask_mod(lengths, total_seq_len, documents, window)
    if flex:
        return document_block_mask(documents, mask_mod, window)
    positions = torch.arange(total_seq_len, device=device)
    return mask_mod(0, 0, positions[:, None], positions[None, :]).view(
        1, 1, total_seq_len, total_seq_len
    )


def step_mask(
    documents: torch.Tensor,
    step: int,
    *,
    flex: bool,
    window: int,
) -> BlockMask | torch.Tensor:
    """The mask of TTT step `step` of a sliding-window draft (see the module's docstring):
    step 0's keys within `window - step` positions, then `step` appended draft-key blocks."""
    if window - step < 1:
        raise InvalidInputError(
            f"a sliding window of {window} positions leaves TTT step {step} no context; "
            "use a window longer than the TTT steps"
        )
    total = documents.numel()
    mask_mod = create_combined_mask_mod(None, total, documents, window - step)
    if flex:
        mask = document_block_mask(documents, mask_mod, window - step)
    else:
        positions = torch.arange(total, device=documents.device)
        mask = mask_mod(0, 0, positions[:, None], positions[None, :]).view(1, 1, total, total)
    for _ in range(step):
        mask = extend_mask_for_draft_tokens(mask)
    return mask


def extend_mask_for_draft_tokens(block_mask: BlockMask | torch.Tensor) -> BlockMask | torch.Tensor:
    """The mask of the next TTT step: one more key block, visible only on its diagonal.

    A `BlockMask` gets, for each query block, one more partial key block (the diagonal block of
    the new step; the mask_mod decides within it); a dense tensor gets an identity block.
    """
    if isinstance(block_mask, BlockMask):
        return _extend_block_mask(block_mask)
    q_len = block_mask.shape[-2]
    diagonal = torch.eye(q_len, dtype=torch.bool, device=block_mask.device)
    diagonal = diagonal.expand(*block_mask.shape[:-2], q_len, q_len)
    return torch.cat([block_mask.to(torch.bool), diagonal], dim=-1)


def _extend_block_mask(block_mask: BlockMask) -> BlockMask:
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    if q_block != kv_block or q_len % q_block:
        raise InvalidInputError(
            f"cannot extend a block mask with blocks {block_mask.BLOCK_SIZE} over {q_len} queries; "
            "build it with create_combined_mask_mod on a row padded to a multiple of the block size"
        )
    counts, indices = block_mask.kv_num_blocks, block_mask.kv_indices
    batch, heads, q_blocks, _ = indices.shape
    # The new step's keys start at kv_len: query block j sees key block kv_len / size + j.
    first_new = kv_len // kv_block
    new_column = (
        torch.arange(first_new, first_new + q_blocks, device=indices.device, dtype=indices.dtype)
        .view(1, 1, q_blocks, 1)
        .expand(batch, heads, q_blocks, 1)
    )
    widened = torch.cat([indices, indices.new_zeros(batch, heads, q_blocks, q_blocks)], dim=-1)
    widened.scatter_(-1, counts.unsqueeze(-1).to(torch.long), new_column)
    full_indices = block_mask.full_kv_indices
    if full_indices is not None:
        full_indices = torch.cat(
            [full_indices, full_indices.new_zeros(batch, heads, q_blocks, q_blocks)], dim=-1
        )
    return BlockMask.from_kv_blocks(
        counts + 1,
        widened,
        block_mask.full_kv_num_blocks,
        full_indices,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
        seq_lengths=(q_len, kv_len + q_len),
    )


def block_mask_to_dense_attention_mask(
    block_mask: BlockMask | torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The mask as a dense `[B, H, q, kv]` tensor of `dtype`: 1 (True) where attention is
    allowed, 0 (False) elsewhere. `dtype=torch.bool` gives an SDPA mask."""
    if not isinstance(block_mask, BlockMask):
        return block_mask.to(device=device, dtype=dtype)
    q_len, kv_len = block_mask.seq_lengths
    batch, heads = block_mask.kv_num_blocks.shape[:2]
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    allowed = block_mask.mask_mod(b, h, q, kv)
    return allowed.expand(batch, heads, q_len, kv_len).to(dtype)


def document_block_mask(
    documents: torch.Tensor, mask_mod: Callable, window: int | None = None
) -> BlockMask:
    """Step 0's `BlockMask`, read off the sample ids (`documents`, `[T]`, T a multiple of 128) one
    128 x 128 block at a time; `mask_mod` decides within the partial blocks.

    `create_block_mask` would evaluate `mask_mod` at all T x T positions, and compiled (as it must
    be on a GPU, or it writes out that mask) it builds kernels for each row length whose build time
    grows with it: minutes at T = 16,384. Here the work is a few small tensor operations on a
    `[T / 128, T / 128]` grid, the same for every length, with nothing to compile. It relies on
    what `document_ids` gives: sample ids never decrease along the row, padding (-1) comes last.
    Key block j < query block i is visible where they share a sample (the last sample of j is
    the first of i) and full where that one sample covers both blocks whole; the diagonal block
    is partial (causal, and a padding position sees itself); later blocks are empty. With a
    `window`, key blocks wholly `window` or more positions back are empty too, and those that
    reach that far partial.
    """
    blocks = documents.view(-1, FLEX_BLOCK_SIZE)
    count = blocks.shape[0]
    first = blocks[:, 0]
    last = blocks.max(dim=-1).values  # the block's last sample (padding, -1, is smaller)
    whole = (first == blocks[:, -1]) & (first >= 0)  # one sample from end to end, no padding
    earlier = torch.ones(count, count, dtype=torch.bool, device=documents.device).tril(-1)
    shared = earlier & (last[None, :] == first[:, None]) & (first[:, None] >= 0)
    full = shared & whole[:, None] & whole[None, :]
    if window is not None:
        blocks_back = torch.arange(count, device=documents.device)
        blocks_back = (blocks_back[:, None] - blocks_back[None, :]) * FLEX_BLOCK_SIZE
        shared = shared & (blocks_back - (FLEX_BLOCK_SIZE - 1) < window)  # its nearest pair
        full = full & shared & (blocks_back + (FLEX_BLOCK_SIZE - 1) < window)  # its farthest
    diagonal = torch.eye(count, dtype=torch.bool, device=documents.device)
    partial = (shared & ~full) | diagonal
    length = documents.numel()
    return BlockMask.from_kv_blocks(
        *_listed_blocks(partial),
        *_listed_blocks(full),
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def _listed_blocks(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[1, 1, q_blocks]` counts and `[1, 1, q_blocks, kv_blocks]` indices of the visible key
    blocks of each query block (ascending, then the others), as `BlockMask` keeps them."""
    counts = visible.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(visible.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None], order.to(torch.int32)[None, None]


def key_capacity(mask: Any, ttt_steps: int) -> dict[str, int]:
    """The keyword `flex_attention_forward` takes to give flex the same key length at every TTT
    step: `ttt_steps` times the row for a `BlockMask`, nothing for a dense mask.

    Step k attends over (k + 1) row lengths of keys. Handed those lengths as they are, the
    compiled flex kernel was built for step 0's length, then again with a symbolic key length
    at step 1 (9.2 s of a cold first step's 43.5 s on an H100 at 8,192 tokens); with every
    step's keys padded to the last step's length it is built once, for fixed shapes. The TTT
    steps' cache (`packed_row.StepKeyValues`) hands the keys over padded; `padded_to_capacity`
    then only widens the mask.
    """
    if not isinstance(mask, BlockMask) or ttt_steps < 2:
        return {}
    if not flex_is_compiled(mask.kv_num_blocks.device):
        return {}  # uncompiled flex evaluates `mask_mod` at every key: no padding there
    return {"kv_capacity": ttt_steps * mask.seq_lengths[0]}


def padded_to_capacity(
    key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, BlockMask]:
    """`key`, `value` zero-padded to `capacity` positions and `block_mask` widened to match.

    The padded key blocks are listed nowhere in the mask, so the compiled kernel, which visits
    only the listed blocks, never reads them: the same blocks in the same order as unpadded,
    and zero gradients for the padding. (Uncompiled flex evaluates `mask_mod` everywhere and
    would see them: this is for the compiled path only.) The mask's count tensors are copied
    so that every step hands flex tensors of one kind (not views at one step, copies at the
    next), which dynamo would otherwise tell apart.
    """
    q_len, kv_len = block_mask.seq_lengths
    if kv_len > capacity or (capacity - kv_len) % block_mask.BLOCK_SIZE[1]:
        raise InvalidInputError(
            f"cannot pad {kv_len} keys to {capacity}: not a whole number of "
            f"{block_mask.BLOCK_SIZE[1]}-key blocks more"
        )
    pad = capacity - key.shape[-2]  # none when the cache padded them (`StepKeyValues`)
    extra_blocks = (capacity - kv_len) // block_mask.BLOCK_SIZE[1]

    def widened(indices: torch.Tensor | None) -> torch.Tensor | None:
        return None if indices is None else F.pad(indices, (0, extra_blocks))

    def copied(counts: torch.Tensor | None) -> torch.Tensor | None:
        return None if counts is None else counts.clone()

    mask = BlockMask.from_kv_blocks(
        copied(block_mask.kv_num_blocks),
        widened(block_mask.kv_indices),
        copied(block_mask.full_kv_num_blocks),
        widened(block_mask.full_kv_indices),
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
        seq_lengths=(q_len, capacity),
    )
    if pad:
        key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
    return key, value, mask


def flex_is_compiled(device: torch.device) -> bool:
    """Whether flex attention runs compiled on `device`: everywhere but on a CPU, where runs are
    small (tests) and compiling costs more than it saves (uncompiled, it materialises every
    score)."""
    return device.type != "cpu"


def _flex(query, key, value, block_mask, scale, enable_gqa, kv_capacity=None):
    """Flex attention, compiled on accelerators (uncompiled it materialises all scores)."""
    if not flex_is_compiled(query.device):
        with warnings.catch_warnings():
            # Uncompiled on purpose: CPU runs are small (tests); compiling costs more there.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(
                query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
            )
    return compiled_flex(query, key, value, block_mask, scale, enable_gqa, kv_capacity)


def compiled_flex(query, key, value, block_mask, scale, enable_gqa, kv_capacity=None):
    """Compiled flex attention, the keys padded to `kv_capacity` first when given
    (`key_capacity`): one kernel for every TTT step."""
    if kv_capacity is not None:
        key, value, block_mask = padded_to_capacity(key, value, block_mask, kv_capacity)
    return maybe_compiled(flex_attention, True)(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
    )


def flex_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    kv_capacity: int | None = None,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' attention interface: `[B, H, L, D]` in, `[B, L, H, D]` out.

    With a `BlockMask`, flex attention (block-sparse); with a dense boolean or additive mask,
    SDPA. Grouped key/value heads are broadcast to the query heads. `kv_capacity`
    (`key_capacity`): the key length every TTT step's compiled flex call is padded to.
    """
    enable_gqa = query.shape[1] != key.shape[1]
    if isinstance(attention_mask, BlockMask):
        # The query keeps its layout: flex writes the output in it, so a query that is a
        # `[B, H, L, D]` view of `[B, L, H, D]` memory gives an output the caller reads as is.
        out = _flex(
            query,
            key.contiguous(),
            value.contiguous(),
            attention_mask,
            scaling,
            enable_gqa,
            kv_capacity,
        )
    else:
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa
        )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_INTERFACE_NAME, flex_attention_forward)


_register()
