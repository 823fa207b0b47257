"""Acceptance counters of speculative decoding, kept the way vLLM's spec-decode metrics keep them.

One *draft* is one verification of one request's proposal. vLLM 0.16 counts per draft the
proposed tokens and the accepted ones (the longest prefix of the proposal that the verifier agrees
with), and per position k how many drafts had their k-th token accepted. From these:
acceptance length tau = 1 + accepted / drafts (the verifier's own token comes free with every
draft), and per-position rate k = accepted at position k / drafts. Both engines of `speculators
eval` fill this one type, so their figures mean the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["AcceptanceCounts"]


@dataclass
class AcceptanceCounts:
    """Totals over many drafts; `observe` adds one draft."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise InvalidInputError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens
        if len(self.accepted_per_position) != self.num_speculative_tokens:
            raise InvalidInputError(
                f"accepted_per_position has {len(self.accepted_per_position)} entries, expected "
                f"num_speculative_tokens={self.num_speculative_tokens}"
            )

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One draft of `num_draft_tokens` proposals whose first `num_accepted_tokens` were kept."""
        if not 0 <= num_accepted_tokens <= min(num_draft_tokens, self.num_speculative_tokens):
            raise InvalidInputError(
                f"{num_accepted_tokens} accepted of {num_draft_tokens} drafted "
                f"(at most {self.num_speculative_tokens} per draft)"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.accepted_per_position[position] += 1

    def merge(self, other: AcceptanceCounts) -> None:
        """Add another set of totals (e.g. another batch) to these."""
        if other.num_speculative_tokens != self.num_speculative_tokens:
            raise InvalidInputError(
                f"cannot merge counts of {other.num_speculative_tokens} and "
                f"{self.num_speculative_tokens} speculative tokens"
            )
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count

    @property
    def acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts (1.0 when nothing was drafted)."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def per_position_rates(self) -> list[float]:
        """Accepted at position k / drafts, for k = 0 .. num_speculative_tokens - 1."""
        if self.num_drafts == 0:
            return [0.0] * self.num_speculative_tokens
        return [count / self.num_drafts for count in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (vLLM's "Avg Draft acceptance rate")."""
        if self.num_draft_tokens == 0:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens
