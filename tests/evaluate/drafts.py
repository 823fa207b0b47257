"""EAGLE-3 drafts for the tiny Llama (4 layers, hidden 256, vocab 512), and scripted proposers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import LlamaConfig

from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.proposals import GreedyTokenProposalConfig
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
from speculators_vllm016.utils.verifier_weights import read_verifier_weights

VOCAB = 512
DRAFT_VOCAB = 128


def build_draft(
    verifier_path: str,
    speculative_tokens: int = 3,
    seed: int = 0,
    layers: int = 1,
    aux_layer_ids: Sequence[int] = (1, 2, 3),
    architectures: Sequence[str] = ("LlamaForCausalLM",),
    draft_vocab: int = DRAFT_VOCAB,
) -> Eagle3DraftModel:
    layer = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_path, architectures=list(architectures)),
        ),
    )
    torch.manual_seed(seed)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: VOCAB - token for token in range(VOCAB)}, draft_vocab, VOCAB
    )
    return Eagle3DraftModel(config, t2d=t2d, d2t=d2t).eval()


def logit_lens_draft(
    verifier: str, architecture: str, aux_id: int = 2, speculative_tokens: int = 3
) -> Eagle3DraftModel:
    """A draft that proposes what the verifier's final norm and LM head make of the residual
    stream entering its layer `aux_id` (its decoder layer reduced to the residual): right often
    enough, and depending on the context, that acceptance is neither 0 nor all."""
    draft = build_draft(
        verifier,
        speculative_tokens=speculative_tokens,
        aux_layer_ids=(1, aux_id, aux_id),
        architectures=(architecture,),
        draft_vocab=VOCAB,
    )
    hidden = draft.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * hidden :] = torch.eye(hidden)  # the third aux state
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(read_verifier_weights(verifier).norm)
    return draft


def scripted_proposer(
    continuations: Sequence[torch.Tensor], pattern: Sequence[bool]
) -> Callable[[tuple, torch.Tensor, int], torch.Tensor]:
    """A `propose_tokens` that knows the verifier's greedy continuation of every prompt.

    `continuations[i]` is prompt i followed by the verifier's greedy tokens (long enough to cover
    every proposal). Position j of a proposal is the true next token if `pattern[j]`, else a wrong
    one.
    """
    right = torch.tensor(list(pattern), dtype=torch.bool)

    def propose(hidden_states: tuple, tokens: torch.Tensor, count: int) -> torch.Tensor:
        assert count == len(right)
        assert all(h.shape[1] == tokens.shape[1] - 1 for h in hidden_states)
        length = tokens.shape[1]
        for full in continuations:
            if torch.equal(full[:length], tokens[0]):
                truth = full[length : length + count]
                assert len(truth) == count, "continuation too short for this test"
                return torch.where(right, truth, (truth + 1) % VOCAB)
        raise AssertionError("tokens are not a prefix of any verifier continuation")

    return propose


class ScriptedDraft(nn.Module):
    """A stand-in draft whose only part is a scripted `propose_tokens` (no incremental proposer,
    so `speculative_generate` asks it row by row with each row's whole history)."""

    def __init__(self, continuations: Sequence[torch.Tensor], pattern: Sequence[bool]) -> None:
        super().__init__()
        self.propose_tokens = scripted_proposer(continuations, pattern)
