"""Greedy token proposal: the draft proposes its argmax tokens, the verifier accepts matches."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from speculators_vllm016.config import TokenProposalConfig

__all__ = ["GreedyTokenProposalConfig"]


@TokenProposalConfig.register("greedy")
class GreedyTokenProposalConfig(TokenProposalConfig):
    proposal_type: Literal["greedy"] = "greedy"
    speculative_tokens: int = Field(
        default=5, ge=1, description="Tokens drafted per verifier step (at least 1)."
    )
    verifier_accept_k: int = Field(
        default=1,
        ge=1,
        description="A draft token is accepted if it is in the verifier's top k (at least 1).",
    )
    accept_tolerance: float = Field(
        default=0.0,
        ge=0.0,
        description="Log-probability slack allowed when accepting a draft token (not negative).",
    )
