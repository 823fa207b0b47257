"""What one forward pass keeps for its packed row across the TTT steps: the row itself (checked,
padded for the attention backend, with its sample ids and step-0 mask) and the keys and values
that each step appends (see `attention` for the masks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from speculators_vllm016.models.eagle3.attention import (
    FLEX_BLOCK_SIZE,
    build_step_zero_mask,
    document_ids,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["PackedRow", "StepKeyValues", "pack_row"]


@dataclass
class PackedRow:
    """A forward pass's row after its checks: what every TTT step reads.

    Padded to `padded` positions for flex attention (whole blocks); the padding sees only
    itself and is never scored or returned.
    """

    hidden_states: torch.Tensor
    """`[1, padded, 3 * target_hidden]` the fused target states."""
    input_ids: torch.Tensor
    """`[1, padded]` step 0's tokens."""
    position_ids: torch.Tensor
    """`[1, padded]` step 0's positions."""
    documents: torch.Tensor
    """`[padded]` the packed sample of each position."""
    mask: Any
    """Step 0's attention mask (a flex `BlockMask` or a dense boolean mask)."""
    total: int
    """The real positions."""
    padded: int
    """The positions with padding."""

    @property
    def device(self) -> torch.device:
        return self.hidden_states.device


def pack_row(
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    lengths: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    *,
    flex: bool,
    pad_to: int | None = None,
    window: int | None = None,
) -> PackedRow:
    """The forward's inputs checked, with their defaults (one sample; positions from 1), padded
    to whole flex blocks when `flex`, and then to at least `pad_to` positions (rounded up to whole
    blocks): rows of one padded length share one compiled shape. `window`: a sliding-window
    draft's window (step 0's mask keeps keys fewer than `window` positions back)."""
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise InvalidInputError(
            f"hidden_states must be [1, seq, 3*hidden], got {tuple(hidden_states.shape)}"
        )
    device = hidden_states.device
    total = hidden_states.shape[1]
    if input_ids.shape != (1, total):
        raise InvalidInputError(f"input_ids must be [1, {total}], got {tuple(input_ids.shape)}")
    if lengths is None:
        lengths = torch.tensor([total], device=device)
    if position_ids is None:
        position_ids = torch.arange(1, total + 1, device=device).unsqueeze(0)
    padded = total
    if flex:
        padded = -(-max(total, pad_to or 0) // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE
    pad = padded - total
    if pad:
        hidden_states = F.pad(hidden_states, (0, 0, 0, pad))
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = F.pad(position_ids.to(device), (0, pad))
    lengths = lengths.to(device)
    documents = document_ids(lengths, padded)
    mask = build_step_zero_mask(
        lengths, padded, flex=flex, device=device, documents=documents, window=window
    )
    return PackedRow(hidden_states, input_ids, position_ids, documents, mask, total, padded)


class StepKeyValues:
    """Keys and values of the TTT steps so far, per layer; each step appends one block.

    Quacks like transformers' `Cache.update` for the layers' attention modules. With a
    `capacity` (`attention.key_capacity`: the compiled flex kernel's one key length) every step's
    keys and values come back zero-padded to it, built by one concatenation: the steps so far,
    the new block and the zeros. Kept padded, they are the very tensors flex saves for its
    backward pass, so the cache holds nothing more. (An unpadded cache, padded again for flex,
    held both and copied twice a step: 2.6 GiB more at the peak of a 32,768-token Kimi-K2.5
    draft step on an H100.)
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lengths: dict[int, int] = {}
        """The real (unpadded) key positions of each layer so far."""

    def update(self, key, value, layer_idx, cache_kwargs=None):
        keys, values = [key], [value]
        length = key.shape[-2]
        if layer_idx in self.layers:
            known = self.lengths[layer_idx]
            old_key, old_value = self.layers[layer_idx]
            keys.insert(0, old_key[..., :known, :])
            values.insert(0, old_value[..., :known, :])
            length += known
        if self.capacity is not None and length > self.capacity:
            raise InvalidInputError(f"{length} key positions exceed the capacity {self.capacity}")
        if self.capacity is not None and length < self.capacity:
            zeros = (*key.shape[:-2], self.capacity - length)
            keys.append(key.new_zeros(*zeros, key.shape[-1]))
            values.append(value.new_zeros(*zeros, value.shape[-1]))
        key = keys[0] if len(keys) == 1 else torch.cat(keys, dim=-2)
        value = values[0] if len(values) == 1 else torch.cat(values, dim=-2)
        self.layers[layer_idx] = (key, value)
        self.lengths[layer_idx] = length
        return key, value
