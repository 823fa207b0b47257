"""Token proposal methods a speculator can declare in its config."""

from speculators_vllm016.proposals.greedy import GreedyTokenProposalConfig

__all__ = ["GreedyTokenProposalConfig"]
