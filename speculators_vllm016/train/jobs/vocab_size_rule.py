"""The draft vocabulary must fit in the target's: the one wording of that mistake.

vocab-mapping, gen-and-train (before datagen) and train (`--draft-vocab-size`) each find it;
all say it with `draft_vocab_too_large`, and the library function that builds the maps raises it.
"""

from __future__ import annotations

__all__ = ["draft_vocab_too_large"]


def draft_vocab_too_large(draft_vocab_size: int, target_vocab_size: int) -> str:
    """The one wording of this mistake, whichever command finds it (the draft predicts a subset
    of the target's tokens)."""
    return (
        f"--draft-vocab-size {draft_vocab_size} is larger than the target's vocabulary of "
        f"{target_vocab_size} tokens; choose at most {target_vocab_size}"
    )
