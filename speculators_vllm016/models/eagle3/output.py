"""The typed output of `Eagle3DraftModel.forward` (transformers' `ModelOutput` idea, kept as a
dataclass that still unpacks as 0.3.0's tuple)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["Eagle3DraftOutput"]


@dataclass
class Eagle3DraftOutput:
    """What one `Eagle3DraftModel.forward` produced.

    `draft_tokens[k]` `[1, T]` are step k's argmax (draft ids). `loss` and `metrics` are set when
    `verifier_last_hidden_states` was given, else None. `logits[k]` are step k's draft logits,
    kept only when asked for (`output_logits=True`).

    It unpacks as 0.3.0's return value did: `draft_tokens, loss, metrics = out` when scored,
    and as the list of draft tokens itself when not (`for tokens in out`, `out[0]`, `len(out)`).
    """

    draft_tokens: list[torch.Tensor]
    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None
    logits: list[torch.Tensor] | None = None

    def as_tuple(self) -> tuple | list[torch.Tensor]:
        """0.3.0's return value: `(draft_tokens, loss, metrics)` when scored, else `draft_tokens`."""
        if self.loss is None:
            return self.draft_tokens
        return (self.draft_tokens, self.loss, self.metrics)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return len(self.as_tuple())

    def __getitem__(self, index: int) -> Any:
        return self.as_tuple()[index]


# DDP finds the tensors of a forward's output by pytree flattening. A plain dataclass is one
# opaque leaf there, and DDP with `static_graph=True` then never routes the loss through its
# backward hook: its ranks silently skip the gradient all-reduce and train apart. Registered,
# the output is taken apart and rebuilt like a tuple.
pytree.register_dataclass(Eagle3DraftOutput)
