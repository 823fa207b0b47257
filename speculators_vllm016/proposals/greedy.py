"""Greedy token proposal: the draft proposes its argmax tokens, the verifier accepts matches."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from speculators_vllm016.config import TokenProposalConfig

__all__ = ["GreedyTokenProposalConfig"]


@TokenProposalConfig.register("greedy")
class GreedyTokenProposalConfig(TokenProposalConfig):
    proposal_type: Literal["greedy"] = "greedy"
    speculative_tokens: int = Field(default=5, description="Tokens drafted per verifier step.")
    verifier_accept_k: int = Field(
        default=1, description="A draft token is accepted if it is in the verifier's top k."
    )
    accept_tolerance: float = Field(
        default=0.0, description="Log-probability slack allowed when accepting a draft token."
    )
