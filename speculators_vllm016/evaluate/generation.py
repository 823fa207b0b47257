"""The one result type of both engines of `speculators eval` (`hf` and `vllm`): what one draft
produced over the prompts, and the acceptance it had."""

from __future__ import annotations

from dataclasses import dataclass

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts

__all__ = ["GenerationResult", "tokens_per_second"]


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Throughput, 0.0 for a run that took no measurable time."""
    return tokens / seconds if seconds > 0 else 0.0


@dataclass
class GenerationResult:
    """What one engine call generated, prompt order kept."""

    outputs: list[list[int]]
    """Generated token ids per prompt (EOS included, if reached)."""
    counts: AcceptanceCounts
    """Acceptance of the draft's proposals (the `vllm` engine: vLLM's own counters)."""
    seconds: float
    """Wall time of the generation (engine start-up excluded)."""
    verifier_passes: int = 0
    """Forward passes of the verifier, prefills included (`hf` engine only; 0 from `vllm`)."""
    prompt_tokens: int = 0
    """Tokens of all prompts (`hf` engine only; 0 from `vllm`)."""

    @property
    def generated_tokens(self) -> int:
        return sum(len(output) for output in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.generated_tokens, self.seconds)
