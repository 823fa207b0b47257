"""Greedy speculative decoding with a transformers verifier: the `hf` engine of `speculators eval`.

The draft proposes `k` tokens (an EAGLE-3 draft through its incremental proposer, which keeps its
own KV cache across rounds; any other draft through `propose_tokens`), the verifier scores the
newest token and the `k` proposals in one forward pass over its KV cache, the longest agreeing
prefix is kept, and the verifier's own token at the first disagreement (or after the last
proposal) comes free. The output is therefore exactly the verifier's greedy output, whatever the
draft proposes; the draft only decides how many tokens each verifier pass yields, which is what
`AcceptanceCounts` records, as vLLM's counters do (the counts are taken before the output is cut
at `max_new_tokens` or EOS).

Prompts run in batches: left-padded, with per-row positions. Every verification appends `k + 1`
slots per row to the cache; the slots of rejected proposals stay there, masked out, so rows that
accept different numbers of tokens share one cache without copying it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts
from speculators_vllm016.evaluate.generation import GenerationResult
from speculators_vllm016.models.verifier_states import ResidualStreamStates
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["speculative_generate"]


@dataclass
class _Row:
    """One prompt in flight: its tokens (prompt and generated)."""

    index: int
    prompt_length: int
    tokens: list[int]
    done: bool = False


class _RowByRowProposals:
    """The reference: `draft.propose_tokens` per row over the row's whole history (no cache).

    Keeps each row's verifier states (`[num_layers + 1, capacity, hidden]`); any draft with
    `propose_tokens` works here.
    """

    def __init__(self, draft: nn.Module, k: int, capacities: list[int]) -> None:
        self.draft = draft
        self.k = k
        self.capacities = capacities
        self.buffers: list[torch.Tensor] = []
        self.filled: list[int] = []

    def select(self, rows: list[int]) -> None:
        self.buffers = [self.buffers[row] for row in rows]
        self.filled = [self.filled[row] for row in rows]

    def propose(self, states, tokens, valid, histories: list[list[int]]) -> torch.Tensor:
        if not self.buffers:
            layers, hidden = len(states), states[0].shape[-1]
            self.buffers = [states[0].new_empty(layers, size, hidden) for size in self.capacities]
            self.filled = [0] * len(self.capacities)
        proposals = []
        for row, history in enumerate(histories):
            columns = valid[row].nonzero()[:, 0]
            count = columns.numel()
            start = self.filled[row]
            self.buffers[row][:, start : start + count] = torch.stack(
                [layer[row, columns] for layer in states]
            )
            self.filled[row] = start + count
            views = tuple(layer[: self.filled[row]].unsqueeze(0) for layer in self.buffers[row])
            device = states[0].device
            proposed = self.draft.propose_tokens(
                views, torch.tensor([history], device=device), self.k
            )
            proposed = torch.as_tensor(proposed, device=device).reshape(-1).long()
            if proposed.numel() != self.k:
                raise InvalidInputError(
                    f"the draft proposed {proposed.numel()} tokens, {self.k} were asked for"
                )
            proposals.append(proposed)
        return torch.stack(proposals)


class _CachedProposals:
    """The draft's own incremental proposer (`draft.incremental_proposer(k)`): a KV cache
    across rounds, all rows in one pass."""

    def __init__(self, draft: nn.Module, k: int) -> None:
        self.proposer = draft.incremental_proposer(k)
        self.k = k

    def select(self, rows: list[int]) -> None:
        self.proposer.select(torch.tensor(rows, device=self.proposer.draft.fc.weight.device))

    def propose(self, states, tokens, valid, histories: list[list[int]]) -> torch.Tensor:
        proposed = self.proposer.propose(states, tokens, valid)
        if proposed.shape != (len(histories), self.k):
            raise InvalidInputError(
                f"the draft proposed {tuple(proposed.shape)} tokens, {self.k} a row were asked for"
            )
        return proposed.to(states[0].device).long()


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _finished(row: _Row, new_tokens: Iterable[int], max_new_tokens: int, eos: set[int]) -> bool:
    return len(row.tokens) - row.prompt_length >= max_new_tokens or any(
        t in eos for t in new_tokens
    )


def _cut(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The first `max_new_tokens` tokens, ending at the first EOS (kept), as `generate` does."""
    tokens = tokens[:max_new_tokens]
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[: position + 1]
    return tokens


def _attention_mask(verifier: PreTrainedModel, keep: torch.Tensor, new: int) -> torch.Tensor:
    """The mask of a pass whose `new` queries are the last `new` of `keep`'s slots.

    `keep` (`[rows, slots]`) is 1 on slots holding a token of the row (not padding, not a rejected
    proposal). For sdpa and eager attention the 4D additive mask is built here (slot j visible to
    query i when kept and not in i's future): transformers' own construction from the 2D mask
    costs more than a small verifier's forward pass. Other attention kernels get the 2D mask.
    """
    if getattr(verifier.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return keep
    slots = keep.shape[1]
    query = torch.arange(slots - new, slots, device=keep.device)[:, None]
    causal = torch.arange(slots, device=keep.device)[None, :] <= query  # [new, slots]
    visible = causal[None] & keep[:, None].bool()
    mask = torch.zeros(visible.shape, dtype=verifier.dtype, device=keep.device)
    mask.masked_fill_(~visible, torch.finfo(verifier.dtype).min)
    return mask[:, None]


@torch.no_grad()
def _run_batch(
    verifier: PreTrainedModel,
    draft: nn.Module,
    prompts: list[tuple[int, list[int]]],
    max_new_tokens: int,
    k: int,
    eos: set[int],
    counts: AcceptanceCounts,
    on_done,
    cached_draft: bool,
    streams: ResidualStreamStates,
) -> tuple[dict[int, list[int]], int]:
    device = _device_of(verifier)
    longest = max(len(prompt) for _, prompt in prompts)
    batch = len(prompts)
    input_ids = torch.zeros(batch, longest, dtype=torch.long, device=device)
    slot_mask = torch.zeros(batch, longest, dtype=torch.long, device=device)
    for position, (_, prompt) in enumerate(prompts):
        input_ids[position, longest - len(prompt) :] = torch.tensor(prompt, device=device)
        slot_mask[position, longest - len(prompt) :] = 1
    position_ids = (slot_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = verifier(
        input_ids=input_ids,
        attention_mask=_attention_mask(verifier, slot_mask, longest),
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    passes = 1
    cache = out.past_key_values
    first = out.logits[:, -1].argmax(-1)
    if cached_draft and hasattr(draft, "incremental_proposer"):
        proposer: _CachedProposals | _RowByRowProposals = _CachedProposals(draft, k)
    else:
        capacities = [len(prompt) + max_new_tokens + k for _, prompt in prompts]
        proposer = _RowByRowProposals(draft, k, capacities)
    # What the draft has not seen yet: verifier states of the newest accepted positions, the
    # token after each, and which columns hold them (left padding in the prefill, right later).
    pending = (
        streams.of(out),
        torch.cat([input_ids[:, 1:], first[:, None]], dim=1),
        slot_mask.bool(),
    )
    rows: list[_Row] = []
    results: dict[int, list[int]] = {}
    for position, (index, prompt) in enumerate(prompts):
        row = _Row(
            index=index, prompt_length=len(prompt), tokens=list(prompt) + [int(first[position])]
        )
        row.done = _finished(row, row.tokens[-1:], max_new_tokens, eos)
        rows.append(row)

    while True:
        active = [position for position, row in enumerate(rows) if not row.done]
        for row in rows:
            if row.done:
                results[row.index] = _cut(row.tokens[row.prompt_length :], max_new_tokens, eos)
                on_done()
        if not active:
            return results, passes
        if len(active) < len(rows):
            selected = torch.tensor(active, device=device)
            cache.batch_select_indices(selected)
            slot_mask = slot_mask[selected]
            proposer.select(active)
            states, tokens, valid = pending
            pending = (
                tuple(layer[selected] for layer in states),
                tokens[selected],
                valid[selected],
            )
            rows = [rows[position] for position in active]

        drafted = proposer.propose(*pending, [row.tokens for row in rows])  # [rows, k]
        newest = torch.tensor([[row.tokens[-1]] for row in rows], device=device)
        starts = torch.tensor([[len(row.tokens) - 1] for row in rows], device=device)
        offsets = torch.arange(k + 1, device=device)
        keep = torch.cat([slot_mask, slot_mask.new_ones(len(rows), k + 1)], dim=1)
        out = verifier(
            input_ids=torch.cat([newest, drafted], dim=1),
            attention_mask=_attention_mask(verifier, keep, k + 1),
            position_ids=starts + offsets,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        passes += 1
        cache = out.past_key_values
        choices = out.logits.argmax(-1)  # [rows, k + 1]: the verifier's token after each input
        agree = (choices[:, :k] == drafted).long().cumprod(dim=1)
        taken = agree.sum(dim=1)  # accepted proposals per row
        accepted_slots = offsets[None] <= taken[:, None]
        slot_mask = torch.cat([slot_mask, accepted_slots.long()], dim=1)
        pending = (streams.of(out), choices, accepted_slots)
        for position, row in enumerate(rows):
            accepted = int(taken[position])
            counts.observe(k, accepted)
            new = choices[position, : accepted + 1].tolist()
            row.tokens.extend(new)
            row.done = _finished(row, new, max_new_tokens, eos)


def _eos_set(eos_token_ids: int | Sequence[int] | None) -> set[int]:
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return {int(token) for token in eos_token_ids}


@torch.no_grad()
def speculative_generate(
    verifier: PreTrainedModel,
    draft: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_speculative_tokens: int,
    eos_token_ids: int | Sequence[int] | None = None,
    batch_size: int = 8,
    show_progress: bool = False,
    cached_draft: bool = True,
) -> GenerationResult:
    """Greedy speculative decoding of `prompts` (token ids); outputs equal the verifier's greedy ones.

    A draft with `incremental_proposer(count)` (an EAGLE-3 draft) proposes for all prompts of a
    batch at once and runs only the positions accepted since its last proposal (its own KV
    cache). Any other draft (or `cached_draft=False`, the reference) needs
    `propose_tokens(verifier_hidden_states, tokens, count)` and is rerun over each prompt's
    whole history for every proposal. Up to `batch_size` prompts share one verifier pass;
    prompts of similar length are batched together to limit padding.
    """
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise InvalidInputError(f"batch_size must be at least 1, got {batch_size}")
    if not prompts:
        raise InvalidInputError("no prompts to generate from")
    empty = [index for index, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise InvalidInputError(f"prompts {empty[:5]} are empty")
    counts = AcceptanceCounts(num_speculative_tokens)
    eos = _eos_set(eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    outputs: dict[int, list[int]] = {}
    passes = 0
    progress = None
    if show_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(prompts), desc="Speculative decoding", unit="prompt")

    def on_done() -> None:
        if progress is not None:
            progress.update(1)

    was_training = draft.training, verifier.training
    draft.eval()
    verifier.eval()
    start = time.perf_counter()
    streams = ResidualStreamStates(verifier)  # aux id N: the last layer's output, pre-norm
    try:
        for first in range(0, len(order), batch_size):
            chunk = [
                (index, [int(t) for t in prompts[index]])
                for index in order[first : first + batch_size]
            ]
            done, batch_passes = _run_batch(
                verifier,
                draft,
                chunk,
                max_new_tokens,
                num_speculative_tokens,
                eos,
                counts,
                on_done,
                cached_draft,
                streams,
            )
            outputs.update(done)
            passes += batch_passes
    finally:
        streams.close()
        seconds = time.perf_counter() - start
        draft.train(was_training[0])
        verifier.train(was_training[1])
        if progress is not None:
            progress.close()
    return GenerationResult(
        outputs=[outputs[index] for index in range(len(prompts))],
        counts=counts,
        seconds=seconds,
        verifier_passes=passes,
        prompt_tokens=sum(len(prompt) for prompt in prompts),
    )
