"""The hf engine: output equals the verifier's greedy output; acceptance counted as vLLM counts it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculators_vllm016.evaluate import speculative
from speculators_vllm016.evaluate.speculative import speculative_generate
from tests.evaluate.drafts import ScriptedDraft, build_draft

PROMPTS = [[0, 17, 250, 3, 99], [0, 5, 6, 7, 8, 9, 10, 11, 12], [0, 300, 2, 45], [0, 77] * 7]
MAX_NEW = 12


@pytest.fixture(scope="module")
def verifier(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft(tiny_llama):
    return build_draft(str(tiny_llama))


def greedy(verifier, prompt, max_new_tokens, eos=None):
    with torch.no_grad():
        out = verifier.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=1,
        )
    return out[0].tolist()


@pytest.fixture(scope="module")
def continuations(verifier):
    """Each prompt with enough greedy tokens to check any proposal of the tests below."""
    return [torch.tensor(greedy(verifier, prompt, MAX_NEW + 8)) for prompt in PROMPTS]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_outputs_are_the_verifiers_greedy_outputs(verifier, draft, batch_size):
    result = speculative_generate(verifier, draft, PROMPTS, MAX_NEW, 3, batch_size=batch_size)
    for prompt, output in zip(PROMPTS, result.outputs):
        assert prompt + output == greedy(verifier, prompt, MAX_NEW)
    counts = result.counts
    assert counts.num_drafts > 0 and counts.num_draft_tokens == 3 * counts.num_drafts
    assert result.generated_tokens == MAX_NEW * len(PROMPTS)


def test_generation_stops_at_eos_like_generate(verifier, draft, continuations):
    # An EOS the verifier emits mid-way through the second prompt's output.
    eos = int(continuations[1][len(PROMPTS[1]) + 4])
    result = speculative_generate(
        verifier, draft, PROMPTS, MAX_NEW, 3, eos_token_ids=[eos], batch_size=4
    )
    for prompt, output in zip(PROMPTS, result.outputs):
        expected = greedy(verifier, prompt, MAX_NEW, eos=eos)
        assert prompt + output == expected
    assert len(result.outputs[1]) <= 5 and result.outputs[1][-1] == eos


def _scripted(continuations, pattern):
    return ScriptedDraft(continuations, pattern)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_an_oracle_draft_reaches_one_plus_k(verifier, continuations, k):
    draft = _scripted(continuations, [True] * k)
    result = speculative_generate(verifier, draft, PROMPTS, MAX_NEW, k, batch_size=2)
    assert result.counts.acceptance_length == 1 + k
    assert result.counts.per_position_rates == [1.0] * k
    for prompt, output, full in zip(PROMPTS, result.outputs, continuations):
        assert prompt + output == full[: len(prompt) + MAX_NEW].tolist()


def test_an_always_wrong_draft_gets_tau_one(verifier, continuations):
    draft = _scripted(continuations, [False] * 3)
    result = speculative_generate(verifier, draft, PROMPTS, MAX_NEW, 3, batch_size=2)
    counts = result.counts
    assert counts.acceptance_length == 1.0 and counts.num_accepted_tokens == 0
    # The prefill yields one token, every verification exactly one more.
    assert counts.num_drafts == (MAX_NEW - 1) * len(PROMPTS)
    for prompt, output, full in zip(PROMPTS, result.outputs, continuations):
        assert prompt + output == full[: len(prompt) + MAX_NEW].tolist()


@pytest.mark.parametrize(
    ("pattern", "rounds", "per_position"),
    [
        # right, right, wrong: 2 accepted + 1 free token a round; 1 + 3 * 4 >= 12 -> 4 rounds.
        ([True, True, False], 4, [4, 4, 0]),
        # right, wrong, right: only the prefix before the first miss counts; 1 + 2 * 6 -> 6 rounds.
        ([True, False, True], 6, [6, 0, 0]),
        # wrong first: nothing after it is accepted even if right.
        ([False, True, True], 11, [0, 0, 0]),
    ],
)
def test_per_position_counts_follow_the_first_miss(
    verifier, continuations, pattern, rounds, per_position
):
    draft = _scripted(continuations, pattern)
    result = speculative_generate(verifier, draft, PROMPTS, MAX_NEW, 3, batch_size=3)
    counts = result.counts
    prompts = len(PROMPTS)
    assert counts.num_drafts == rounds * prompts
    assert counts.accepted_per_position == [n * prompts for n in per_position]
    assert counts.num_accepted_tokens == sum(per_position) * prompts
    assert counts.acceptance_length == pytest.approx(1 + sum(per_position) / rounds)
    for prompt, output, full in zip(PROMPTS, result.outputs, continuations):
        assert prompt + output == full[: len(prompt) + MAX_NEW].tolist()


def _record_proposals(monkeypatch, proposals_class) -> dict[tuple[int, ...], list[int]]:
    """Every proposal made, keyed by the history it was made after."""
    seen: dict[tuple[int, ...], list[int]] = {}
    original = proposals_class.propose

    def propose(self, states, tokens, valid, histories):
        drafted = original(self, states, tokens, valid, histories)
        for history, row in zip(histories, drafted.tolist()):
            seen[tuple(history)] = row
        return drafted

    monkeypatch.setattr(proposals_class, "propose", propose)
    return seen


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_cached_draft_proposes_what_the_uncached_reference_proposes(
    verifier, draft, monkeypatch, batch_size
):
    """Every proposal, through the whole loop (rows leaving the batch included), is the one
    `propose_tokens` makes from the row's whole history."""
    cached_seen = _record_proposals(monkeypatch, speculative._CachedProposals)
    reference_seen = _record_proposals(monkeypatch, speculative._RowByRowProposals)
    prompts = PROMPTS + [[0, 9]]  # unequal lengths: rows finish at different rounds
    cached = speculative_generate(verifier, draft, prompts, MAX_NEW, 3, batch_size=batch_size)
    reference = speculative_generate(
        verifier, draft, prompts, MAX_NEW, 3, batch_size=batch_size, cached_draft=False
    )
    assert cached.outputs == reference.outputs
    assert len(cached_seen) == cached.counts.num_drafts > 0
    assert cached_seen == reference_seen
    assert cached.counts.accepted_per_position == reference.counts.accepted_per_position


def test_a_sliding_window_draft_proposes_alike_cached_and_from_the_whole_history(
    verifier, tiny_llama, monkeypatch
):
    """The hf engine's incremental proposer and the training forward pass (the reference runs it
    over each whole history) apply the same window, on histories four times as long as it."""
    windowed = build_draft(str(tiny_llama), sliding_window=4)
    cached_seen = _record_proposals(monkeypatch, speculative._CachedProposals)
    reference_seen = _record_proposals(monkeypatch, speculative._RowByRowProposals)
    cached = speculative_generate(verifier, windowed, PROMPTS, MAX_NEW, 3, batch_size=2)
    reference = speculative_generate(
        verifier, windowed, PROMPTS, MAX_NEW, 3, batch_size=2, cached_draft=False
    )
    assert cached_seen == reference_seen and len(cached_seen) > 0
    assert cached.counts.accepted_per_position == reference.counts.accepted_per_position
    # The window matters: the same weights with full attention read other keys past 4 back.
    history = torch.tensor([PROMPTS[3] + PROMPTS[1]])
    with torch.no_grad():
        states = verifier(history, output_hidden_states=True).hidden_states
        fused = windowed.fuse_verifier_states([s[:, :-1] for s in states])
        shifted = history[:, 1:]
        logits = [
            torch.cat(model(fused, shifted, ttt_steps=3, output_logits=True).logits, dim=1)
            for model in (windowed, build_draft(str(tiny_llama)))
        ]
    assert torch.allclose(logits[0][:, :4], logits[1][:, :4], atol=1e-5)  # within the window
    assert not torch.allclose(logits[0][:, 4:], logits[1][:, 4:], atol=1e-3)


def test_bad_arguments_are_refused(verifier, draft):
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(verifier, draft, PROMPTS, 0, 3)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(verifier, draft, [[]], 4, 3)
