"""`SpeculatorModel.generate`: greedy speculative decoding with an attached verifier.

The draft is an `Eagle3DraftModel` used only through the public API; its proposals are either
scripted (to check verification) or forced through its weights (to check the draft-to-target id
mapping), so these tests hold whatever the draft's internals look like.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.proposals import GreedyTokenProposalConfig

VOCAB = 512
DRAFT_VOCAB = 128


def make_draft(verifier_path: str, kept: list[int]) -> Eagle3DraftModel:
    """A draft whose vocabulary is the target ids `kept` (sorted)."""
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            num_hidden_layers=1,
            vocab_size=VOCAB,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
        ),
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_path, architectures=["LlamaForCausalLM"]),
        ),
    )
    target_ids = torch.tensor(sorted(kept))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    d2t = target_ids - torch.arange(DRAFT_VOCAB)
    torch.manual_seed(0)
    return Eagle3DraftModel(config, t2d=t2d, d2t=d2t)


@pytest.fixture(scope="module")
def verifier(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()


def greedy(verifier, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return verifier.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )


def speculate(draft, verifier, prompt: torch.Tensor, max_new_tokens: int, k: int) -> torch.Tensor:
    if (
        draft.verifier_attachment_mode != "detached"
    ):  # a draft built for training holds its verifier
        draft.detach_verifier()
    draft.attach_verifier(verifier, mode="full")
    try:
        return draft.generate(prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=k)
    finally:
        draft.detach_verifier()


# R: the verifier's own next token there; W: a token it would not pick. Only the matching prefix
# of a round's proposals may be accepted: a right proposal after a wrong one was drafted from a
# sequence the verifier rejected.
@pytest.mark.parametrize("pattern", ["RWR", "WRR", "RRW", "RWRR", "RRRR", "WWWW"])
def test_only_the_matching_prefix_of_the_proposals_is_accepted(
    tiny_llama, verifier, monkeypatch, pattern
):
    prompt = torch.tensor([[0, 5, 6, 7, 8]])
    max_new_tokens = 14
    truth = greedy(verifier, prompt, max_new_tokens + len(pattern) + 1)
    draft = make_draft(str(tiny_llama), list(range(DRAFT_VOCAB)))

    def propose(hidden_states, tokens, count):
        assert count == len(pattern)
        start = tokens.shape[1]
        assert torch.equal(tokens[0], truth[0, :start]), "generate fed the draft a wrong prefix"
        right = truth[0, start : start + count]
        return torch.where(torch.tensor([c == "R" for c in pattern]), right, (right + 1) % VOCAB)

    monkeypatch.setattr(draft, "propose_tokens", propose)
    output = speculate(draft, verifier, prompt, max_new_tokens, k=len(pattern))
    assert torch.equal(output, truth[:, : prompt.shape[1] + max_new_tokens])
    acceptance = draft.last_acceptance
    rounds, remainder = divmod(acceptance["proposed"], len(pattern))
    assert remainder == 0 and rounds >= 1
    prefix = len(pattern) - len(pattern.lstrip("R"))
    assert acceptance["accepted"] == rounds * prefix, acceptance


def test_proposals_are_mapped_from_draft_ids_to_target_ids(tiny_llama, verifier):
    """The draft's vocabulary is target ids 300..427: its draft id 0 is target id 300.

    The verifier is made to always pick 300 and the draft to always pick its first token (draft id
    0); every proposal is right only if it is turned into a target id through `d2t`.
    """
    chosen = 300
    forced = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()
    head = torch.nn.Linear(forced.config.hidden_size, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[chosen] = 1.0
    forced.lm_head = head
    draft = make_draft(str(tiny_llama), list(range(chosen, chosen + DRAFT_VOCAB)))
    with torch.no_grad():
        draft.state_dict()["lm_head.weight"].zero_()  # all-equal logits: argmax is draft id 0
    prompt = torch.tensor([[0, 17, 250, 3]])
    output = speculate(draft, forced, prompt, max_new_tokens=10, k=3)
    assert output[0, prompt.shape[1] :].tolist() == [chosen] * 10
    acceptance = draft.last_acceptance
    assert acceptance["proposed"] >= 9
    assert acceptance["accepted"] == acceptance["proposed"], acceptance
