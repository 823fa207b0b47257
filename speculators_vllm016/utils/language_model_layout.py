"""Where a checkpoint keeps its language model's tensors: the one table of those layouts.

A plain causal LM stores `model.*` (embeddings, decoder layers, final norm) and `lm_head.*`;
multimodal wrappers store the same tensors under a prefix of their own, beside a vision tower
that a text-only user (the draft, the hf evaluation engine) never reads. A layout maps each
stored name to the plain causal LM's name and back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["LANGUAGE_MODEL_LAYOUTS", "LanguageModelLayout", "find_language_model_layout"]


@dataclass(frozen=True)
class LanguageModelLayout:
    """The prefixes under which one checkpoint layout stores a causal LM's `model.` and `lm_head.`."""

    description: str
    model_prefix: str
    """Stored prefix of the decoder (`model.` in a causal LM): embeddings, layers, final norm."""
    head_prefix: str
    """Stored prefix of the LM head (`lm_head.` in a causal LM)."""

    def stored_name(self, causal_name: str) -> str:
        """The checkpoint's name for a causal LM tensor name (`model.norm.weight`, `lm_head.weight`)."""
        if causal_name.startswith("lm_head."):
            return self.head_prefix + causal_name.removeprefix("lm_head.")
        if causal_name.startswith("model."):
            return self.model_prefix + causal_name.removeprefix("model.")
        raise InvalidInputError(
            f"{causal_name!r} is not a causal LM tensor name (model.* or lm_head.*)"
        )

    def causal_name(self, stored_name: str) -> str | None:
        """The causal LM's name of a stored tensor; None for tensors outside the language model
        (a vision tower, a projector)."""
        if stored_name.startswith(self.head_prefix):
            return "lm_head." + stored_name.removeprefix(self.head_prefix)
        if stored_name.startswith(self.model_prefix):
            return "model." + stored_name.removeprefix(self.model_prefix)
        return None


# In the order tried; the embeddings' module tells them apart.
LANGUAGE_MODEL_LAYOUTS: tuple[LanguageModelLayout, ...] = (
    LanguageModelLayout("causal LM", "model.", "lm_head."),
    LanguageModelLayout(
        "multimodal wrapper (Llama-4 / Qwen-VL style)", "model.language_model.", "lm_head."
    ),
    LanguageModelLayout(
        "Kimi-K2.5 style wrapper", "language_model.model.", "language_model.lm_head."
    ),
    # Some re-quantized Kimi-K2.5 releases (an NVFP4 one) drop the inner `model.`.
    LanguageModelLayout(
        "Kimi-K2.5 style wrapper without the inner model.",
        "language_model.",
        "language_model.lm_head.",
    ),
    LanguageModelLayout("bare language model", "", "lm_head."),
)


def find_language_model_layout(names: Iterable[str]) -> LanguageModelLayout | None:
    """The layout whose token embeddings the checkpoint holds (stored plain or quantized)."""
    names = list(names)
    for layout in LANGUAGE_MODEL_LAYOUTS:
        embeddings = layout.model_prefix + "embed_tokens."
        if any(name.startswith(embeddings) for name in names):
            return layout
    return None
