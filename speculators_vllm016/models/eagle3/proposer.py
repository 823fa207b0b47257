"""Incremental, batched EAGLE-3 proposals for speculative decoding (the `hf` eval engine).

`Eagle3DraftModel.propose_tokens` reruns the draft over a row's whole history for every
proposal; this proposer keeps the draft's step-0 keys and values across rounds, so each round
runs only the positions the verifier accepted since the last one, for many rows at once.

Why it is the same computation: at TTT step 0 position t sees the step-0 keys of positions
0..t, which depend only on the verifier states and tokens up to t, and those never change once
accepted. Steps 1..count-1 matter only at a row's newest position, which sees the step-0 keys
and its own keys of the earlier steps (the diagonal of the training mask); those are kept only
for the round. Rows hold different numbers of new positions: every round appends the same
number of key slots to each row, and the slots of padding are masked out for good. A
sliding-window draft (`attention_window`) sees, as vLLM serves it, only the keys fewer than its
window positions behind the query's own position (each kept slot remembers its position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from speculators_vllm016.models.eagle3.model_definitions import (
    FirstLayerWeightCache,
    autocast_dtype,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["Eagle3Proposer", "ProposingDraft"]


class ProposingDraft(Protocol):
    """What the proposer uses of an `Eagle3DraftModel` (its public surface; `core` imports this
    module, not the other way round)."""

    fc: nn.Linear
    embed_tokens: nn.Embedding
    d2t: torch.Tensor
    attention_window: int | None
    config: Any

    def fuse_aux_states(self, states: torch.Tensor) -> torch.Tensor: ...

    def fuse_verifier_states(
        self, verifier_hidden_states: Sequence[torch.Tensor]
    ) -> torch.Tensor: ...

    def prepare_blocks(self, device: torch.device) -> bool: ...

    def run_layers(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Any,
        cache: Any,
        weight_cache: FirstLayerWeightCache,
    ) -> torch.Tensor: ...

    def final_norm(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def draft_argmax(self, normed: torch.Tensor) -> torch.Tensor: ...


class _RoundKeyValues:
    """Keys and values per layer: the kept slots of earlier rounds, plus this round's scratch.

    Quacks like transformers' `Cache.update`. `keep=True` appends for good (step 0);
    `keep=False` appends to a scratch list that `drop_scratch` forgets (steps 1..count-1).
    """

    def __init__(self) -> None:
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keep = True

    def update(self, key, value, layer_idx, cache_kwargs=None):
        store = self.kept if self.keep else self.scratch
        if layer_idx in store:
            old_key, old_value = store[layer_idx]
            store[layer_idx] = (
                torch.cat([old_key, key], dim=-2),
                torch.cat([old_value, value], dim=-2),
            )
        else:
            store[layer_idx] = (key, value)
        if self.keep:
            return store[layer_idx]
        kept_key, kept_value = self.kept[layer_idx]
        scratch_key, scratch_value = store[layer_idx]
        return torch.cat([kept_key, scratch_key], dim=-2), torch.cat(
            [kept_value, scratch_value], dim=-2
        )

    def drop_scratch(self) -> None:
        self.scratch = {}

    def select(self, rows: torch.Tensor) -> None:
        self.kept = {layer: (k[rows], v[rows]) for layer, (k, v) in self.kept.items()}


class Eagle3Proposer:
    """Proposes `count` tokens per row from the verifier states accepted since the last call.

    `propose(states, tokens, valid)`: `states` are transformers' `output_hidden_states` of the
    new positions (`[rows, n, hidden]` each; entry i is the input of verifier layer i), `tokens`
    `[rows, n]` the token after each of those positions, `valid` `[rows, n]` marks the row's new
    positions (one contiguous run, in order; the rest is padding). Returns `[rows, count]`
    target ids, what `propose_tokens` returns for each row's whole history. `select(rows)` keeps
    only those rows (finished prompts leave the batch).
    """

    def __init__(self, draft: ProposingDraft, count: int) -> None:
        if count < 1:
            raise InvalidInputError(f"the draft must propose at least 1 token, got {count}")
        self.draft = draft
        self.count = count
        self.cache = _RoundKeyValues()
        self.slots: torch.Tensor | None = None  # [rows, slots] bool: kept slot holds a position
        self.consumed: torch.Tensor | None = None  # [rows] positions run so far
        self.slot_positions: torch.Tensor | None = None  # [rows, slots] position of each slot

    def _near(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """`[rows, q, k]` True where a key is within the draft's window of a query (all True for
        full attention)."""
        back = query_positions[:, :, None] - key_positions[:, None, :]
        window = self.draft.attention_window
        return back < window if window is not None else torch.ones_like(back, dtype=torch.bool)

    def select(self, rows: torch.Tensor) -> None:
        if self.slots is None:
            return
        self.slots = self.slots[rows]
        self.slot_positions = self.slot_positions[rows]
        self.consumed = self.consumed[rows]
        self.cache.select(rows)

    def _run_layers(
        self, embeds, hidden, position_ids, mask, weights: FirstLayerWeightCache
    ) -> torch.Tensor:
        return self.draft.run_layers(embeds, hidden, position_ids, mask, self.cache, weights)

    def _predict(
        self, hidden: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids of the draft's argmax at `hidden` `[rows, 1, hidden]`, and the state the
        next step reads: `hidden` itself, or with EAGLE-3.1's `norm_output` its normed form."""
        normed = self.draft.final_norm(hidden[:, 0], dtype)
        draft_ids = self.draft.draft_argmax(normed)
        fed = normed[:, None] if self.draft.config.norm_output else hidden
        return draft_ids + self.draft.d2t[draft_ids], fed

    @torch.no_grad()
    def propose(
        self, states: tuple[torch.Tensor, ...], tokens: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        draft = self.draft
        device = draft.fc.weight.device
        valid = valid.to(device=device, dtype=torch.bool)
        rows, new = valid.shape
        if tokens.shape != (rows, new):
            raise InvalidInputError(
                f"tokens must be [{rows}, {new}] like valid, got {tuple(tokens.shape)}"
            )
        if not bool(valid.any(dim=1).all()):
            raise InvalidInputError("every row needs at least one new position to propose from")
        draft.prepare_blocks(device)
        if self.slots is None:
            self.slots = valid.new_zeros(rows, 0)
            self.consumed = torch.zeros(rows, dtype=torch.long, device=device)
            self.slot_positions = torch.zeros(rows, 0, dtype=torch.long, device=device)

        # Step 0 over the new positions; position t of the history has position id t + 1.
        hidden = draft.fuse_aux_states(draft.fuse_verifier_states(states).to(device))
        dtype = hidden.dtype
        order = valid.long().cumsum(dim=1)  # 1-based rank of each new position in its row
        position_ids = self.consumed[:, None] + order
        causal = torch.ones(new, new, dtype=torch.bool, device=device).tril()
        own = torch.eye(new, dtype=torch.bool, device=device)
        fresh = causal[None] & valid[:, None, :] & self._near(position_ids, position_ids)
        fresh = fresh | own[None]  # padding sees only itself
        old = self.slots[:, None, :] & self._near(position_ids, self.slot_positions)
        mask = torch.cat([old, fresh], dim=-1)[:, None]
        embeds = draft.embed_tokens(tokens.to(device)).to(dtype)
        # One cast of the first layer's weights serves every step of this round.
        weights = FirstLayerWeightCache(autocast_dtype(device.type))
        self.cache.keep = True
        hidden = self._run_layers(embeds, hidden, position_ids, mask, weights)
        self.slots = torch.cat([self.slots, valid], dim=1)
        self.slot_positions = torch.cat([self.slot_positions, position_ids], dim=1)
        self.consumed = self.consumed + valid.sum(dim=1)

        # Steps 1..count-1 at each row's newest position only.
        last = (order * valid).argmax(dim=1)  # index of the row's last new position
        pick = torch.arange(rows, device=device)
        hidden = hidden[pick, last][:, None]  # [rows, 1, hidden]
        position_ids = position_ids[pick, last][:, None]
        proposal, hidden = self._predict(hidden, dtype)
        proposals = [proposal]
        self.cache.keep = False
        try:
            for step in range(1, self.count):
                near = self._near(position_ids + step, self.slot_positions)[:, 0]
                kept = self.slots & near
                mask = torch.cat([kept, self.slots.new_ones(rows, step)], dim=1)[:, None, None, :]
                embeds = draft.embed_tokens(proposals[-1][:, None]).to(dtype)
                hidden = self._run_layers(embeds, hidden, position_ids + step, mask, weights)
                proposal, hidden = self._predict(hidden, dtype)
                proposals.append(proposal)
        finally:
            self.cache.keep = True
            self.cache.drop_scratch()
        return torch.stack(proposals, dim=1)
