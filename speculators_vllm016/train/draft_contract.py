"""What the trainer needs of a draft model, written down: the call's options, the output, the
optional capabilities it uses.

The trainer calls `model(**inputs, **options)` on one packed row (`inputs`: `train.data`'s
`MODEL_INPUTS`, `options`: a `DraftCallOptions`) and reads a `DraftOutput` back (or 0.3.0's
`(draft_tokens, loss, metrics)` tuple). Two capabilities are optional, and named here as
protocols instead of being probed attribute by attribute:

- `StoresFrozenWeights`: the draft can keep its frozen verifier copies (embeddings, final norm,
  LM head) in bf16 when training under bf16 autocast.
- `FusesVerifierStates`: the draft's input widths are known (`fc` fuses the verifier's auxiliary
  states; `target_hidden_size` is the verifier's width), so the trainer can build the one-token
  empty row a step needs when all samples of its row were unusable.

`Eagle3DraftModel` satisfies all three.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "DraftCallOptions",
    "DraftOutput",
    "FusesVerifierStates",
    "StoresFrozenWeights",
    "loss_and_metrics",
]


@dataclass(frozen=True, eq=False)
class DraftCallOptions(Mapping[str, Any]):
    """Keyword arguments of the draft's training or validation call; None leaves the model's
    default. A read-only mapping of the options that are set, so `model(**options)` and 0.3.0's
    `train_call_kwargs={...}` dicts keep working (`coerce` turns such a dict into this)."""

    ttt_steps: int | None = None
    """Test-time-training steps unrolled per row (the draft's own chain length in training)."""
    ttt_step_loss_decay: float | None = None
    """Weight of step k's loss is this to the power k (1.0: all steps weigh the same)."""
    use_off_policy_tokens: bool | None = None
    """Feed the ground-truth tokens to steps k > 0 instead of the draft's own argmax."""

    @classmethod
    def coerce(cls, value: DraftCallOptions | Mapping[str, Any] | None) -> DraftCallOptions:
        """This type from itself, a dict of the same names (0.3.0's form) or None."""
        if isinstance(value, cls):
            return value
        given = dict(value or {})
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(
                f"unknown draft call options {unknown}; the trainer passes {sorted(known)}"
            )
        return cls(**given)

    def _set(self) -> dict[str, Any]:
        return {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if getattr(self, item.name) is not None
        }

    def __getitem__(self, key: str) -> Any:
        return self._set()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={value!r}" for name, value in self._set().items())
        return f"DraftCallOptions({body})"


@runtime_checkable
class DraftOutput(Protocol):
    """A typed model output: the training loss (None without verifier targets) and its metrics."""

    loss: torch.Tensor | None
    metrics: dict[str, torch.Tensor] | None


@runtime_checkable
class StoresFrozenWeights(Protocol):
    def frozen_weights_to(self, dtype: torch.dtype) -> None:
        """Store the frozen (never trained) weights in `dtype`."""


@runtime_checkable
class FusesVerifierStates(Protocol):
    target_hidden_size: int
    """Width of the verifier's hidden states (`verifier_last_hidden_states`' last dimension)."""
    fc: torch.nn.Linear
    """Fuses the verifier's auxiliary states: `in_features` is `hidden_states`' last dimension."""


def loss_and_metrics(output: DraftOutput | tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from a `DraftOutput` or 0.3.0's `(draft_tokens, loss, metrics)`."""
    if isinstance(output, DraftOutput):
        loss, metrics = output.loss, output.metrics
    else:
        _, loss, metrics = output
    if loss is None:
        raise InvalidInputError(
            "the model returned no loss: the batch lacks verifier_last_hidden_states"
        )
    return loss, dict(metrics or {})
