"""Whether a draft was trained for the verifier it is evaluated with, checked before any model
loads: the verifier must have the layers the draft fuses, hidden states of the width it reads,
and the vocabulary it embeds. A mismatch otherwise surfaces deep in generation as an
`IndexError` or a matrix-shape error; here it is one line naming what differs (as training and
conversion do).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.text_config import text_config_of

__all__ = ["VerifierShape", "check_verifier_matches", "expected_verifier"]


@dataclass(frozen=True)
class VerifierShape:
    """What a draft needs of its verifier (None: the draft's config does not say)."""

    aux_layer_ids: tuple[int, ...] | None = None
    """Verifier layers whose hidden states the draft fuses, as vLLM counts them (layer inputs)."""
    hidden_size: int | None = None
    vocab_size: int | None = None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def expected_verifier(draft_config: Any) -> VerifierShape:
    """The verifier a draft's config describes (an EAGLE-3 config; other drafts say less)."""
    layer = getattr(draft_config, "transformer_layer_config", None)
    hidden = getattr(draft_config, "target_hidden_size", None) or getattr(
        layer, "hidden_size", None
    )
    ids = getattr(draft_config, "eagle_aux_hidden_state_layer_ids", None)
    return VerifierShape(
        aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
        hidden_size=_int(hidden),
        vocab_size=_int(getattr(layer, "vocab_size", None)),
    )


def check_verifier_matches(
    draft: str, expected: VerifierShape, verifier: str, verifier_config: Mapping[str, Any]
) -> None:
    """Raise `ValueError` (one line) when `verifier`'s config differs from what `draft` needs."""
    text = text_config_of(verifier_config)
    layers, hidden, vocab = (
        _int(text.get(key)) for key in ("num_hidden_layers", "hidden_size", "vocab_size")
    )
    problems = []
    if expected.aux_layer_ids and layers is not None and max(expected.aux_layer_ids) >= layers:
        problems.append(
            f"it fuses layers {list(expected.aux_layer_ids)}, the verifier has {layers} layers"
        )
    if expected.hidden_size is not None and hidden is not None and expected.hidden_size != hidden:
        problems.append(
            f"it reads hidden states {expected.hidden_size} wide, the verifier's are {hidden} wide"
        )
    if expected.vocab_size is not None and vocab is not None and expected.vocab_size != vocab:
        problems.append(
            f"it embeds a vocabulary of {expected.vocab_size} tokens, the verifier's has {vocab}"
        )
    if problems:
        raise InvalidInputError(
            f"the draft {draft} does not match the verifier {verifier} ({'; '.join(problems)}); "
            "evaluate it with the verifier it was trained for (--verifier)"
        )
