"""The incremental EAGLE-3 proposer proposes exactly what `propose_tokens` proposes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculators_vllm016.models.eagle3.proposer import Eagle3Proposer
from tests.evaluate.drafts import VOCAB, build_draft

K = 3


@pytest.fixture(scope="module")
def verifier(tiny_llama):
    # float64 everywhere: cached and uncached attention sum in different orders, and a near tie
    # of two random logits must not flip an argmax.
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64).eval()


@pytest.fixture(scope="module", params=[1, 2], ids=["one_layer", "two_layers"])
def draft(request, tiny_llama):
    return build_draft(str(tiny_llama), layers=request.param, seed=request.param).double()


def _states(verifier, sequence: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return verifier(sequence[None], output_hidden_states=True).hidden_states


def test_proposals_match_the_uncached_draft_round_by_round(verifier, draft):
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB, (length,), generator=generator) for length in (40, 33, 37)]
    states = [_states(verifier, sequence) for sequence in sequences]
    filled = [5, 9, 2]  # prompt lengths: the prefill gives the states of every prompt token
    new = list(filled)
    rows = [0, 1, 2]
    proposer = Eagle3Proposer(draft, K)
    for round_index in range(8):
        width = max(new[row] for row in rows)
        left_padded = round_index == 0  # the prefill is left-padded, verifications right-padded
        batch_states = [
            torch.zeros(len(rows), width, s.shape[-1], dtype=s.dtype) for s in states[0]
        ]
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for slot, row in enumerate(rows):
            count, first = new[row], filled[row] - new[row]
            columns = slice(width - count, width) if left_padded else slice(0, count)
            for layer, full in zip(batch_states, states[row]):
                layer[slot, columns] = full[0, first : filled[row]]
            tokens[slot, columns] = sequences[row][first + 1 : filled[row] + 1]
            valid[slot, columns] = True
        proposed = proposer.propose(tuple(batch_states), tokens, valid)
        for slot, row in enumerate(rows):
            history = sequences[row][: filled[row] + 1][None]
            views = tuple(layer[:, : filled[row]] for layer in states[row])
            expected = draft.propose_tokens(views, history, K)
            assert proposed[slot].tolist() == expected.tolist(), (round_index, row)
        if round_index == 3:  # the middle row finishes: it leaves the batch and its cache
            proposer.select(torch.tensor([0, 2]))
            rows = [0, 2]
        for row in rows:
            new[row] = int(torch.randint(1, K + 2, (1,), generator=generator))
            filled[row] += new[row]


def test_bad_input_is_refused(draft):
    proposer = Eagle3Proposer(draft, K)
    states = tuple(torch.zeros(1, 2, 256, dtype=torch.float64) for _ in range(5))
    with pytest.raises(ValueError, match="at least one new position"):
        proposer.propose(
            states, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="tokens must be"):
        proposer.propose(
            states, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="at least 1 token"):
        Eagle3Proposer(draft, 0)
