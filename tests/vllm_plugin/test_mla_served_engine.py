"""The MLA draft served by vLLM 0.16's own speculative decoding on the CPU build (#47 item 2):
on the tiny DeepSeek-V3 and on the tiny Kimi-K2.5 wrapper, vLLM's greedy output with the draft is
the output of `eval --engine hf` (the verifier's greedy tokens), and vLLM's acceptance counters
(drafts, accepted tokens, accepted per position) equal those `eval --engine hf` counts.

The draft reads the target's last layer's output almost unchanged (`fc` picks that aux state, id
3 of a 3-layer target: the stream before the final norm, as vLLM captures it and the `hf` engine
now reads it too; reading transformers' normed last state instead made hf count 1 accepted of 129
against vLLM's 2 of 126; its attention and MLP write small random updates onto it) and proposes through the verifier's norm and head: right
often enough for acceptance to be neither 0 nor all (21 of 267 draft tokens, at each of the
three positions, on these prompts), and every part of the MLA layer (latent
projections, rotary key, attention over the draft's own KV cache across steps) still changes the
proposals, so a served layer that computed anything else would move the counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.train.jobs.draft_build import build_draft_config
from speculators_vllm016.utils.verifier_weights import read_verifier_weights
from tests.vllm_plugin.served import HfRun, Served, hf_speculative, serve

pytestmark = pytest.mark.engine

K = 3
MAX_TOKENS = 12


def lens_mla_draft(target: Path, folder: Path) -> Path:
    """An MLA draft whose first proposal is nearly the verifier's own next token (its final norm
    and head on its last layer's output), nudged by a small random MLA layer, and whose later
    proposals run on its own states (see the module docstring)."""
    from transformers import DeepseekV3Config

    config = json.loads((target / "config.json").read_text())
    text = DeepseekV3Config(**config.get("text_config", config))
    draft_config = build_draft_config(
        str(target),
        SimpleNamespace(architectures=config["architectures"], model_type=config["model_type"]),
        text,
        draft_vocab=512,
        num_layers=1,
        norm_before_residual=False,
        ttt_steps=K,
        aux_layer_ids=[1, 2, 3],  # distinct: the target returns one state per listed layer
        draft_arch="mla",
    )
    t2d = torch.ones(512, dtype=torch.bool)
    d2t = torch.zeros(512, dtype=torch.long)
    draft = Eagle3DraftModel(draft_config, t2d=t2d, d2t=d2t)
    hidden = draft.hidden_size
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in draft.layers.named_parameters():
            if parameter.dim() == 2:
                scale = 0.01 if ("o_proj" in name or "down_proj" in name) else 0.1
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * hidden :] = torch.eye(hidden)  # the last layer's output (id 3)
        draft.norm.weight.copy_(read_verifier_weights(str(target)).norm)
    draft.save_pretrained(folder)
    return folder


def prompts() -> list[list[int]]:
    """Four random prompts, and six of one token repeated: on those the tiny target's greedy
    continuation runs through repeats (e.g. 252 four times after [101] * 6), where the lens is
    right several steps in a row, so that the draft's later steps (its own states and KV cache)
    are accepted too, not only its first."""
    generator = torch.Generator().manual_seed(11)
    random = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (9, 17, 26, 40)]
    return random + [[token] * 6 for token in (101, 86, 114, 150, 172, 94)]


def served(target: Path, draft: Path, requests: list[list[int]]) -> Served:
    config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    return serve(
        target,
        config,
        requests,
        MAX_TOKENS,
        passes=1,
        prefix_caching=False,
        max_model_len=256,
        max_num_seqs=4,
    )


def reference(verifier: Path, draft: Path, requests: list[list[int]]) -> HfRun:
    """What `eval --engine hf` computes: our draft with transformers' verifier, greedy."""
    return hf_speculative(verifier, draft, requests, MAX_TOKENS, K, verifier_weights=True)


@pytest.mark.parametrize("target_name", ["tiny_deepseek_v3", "tiny_kimi_k25"])
def test_served_mla_draft_is_lossless_and_accepts_as_eval_hf(target_name, request, tmp_path):
    target = request.getfixturevalue(target_name)
    draft = lens_mla_draft(target, tmp_path / "draft")
    requests = prompts()
    ours = reference(target, draft, requests)
    theirs = served(target, draft, requests)
    assert theirs.first == ours.outputs  # vLLM with the draft = the verifier's greedy tokens
    assert 0 < ours.counts.num_accepted_tokens < ours.counts.num_draft_tokens
    assert all(accepted > 0 for accepted in ours.counts.accepted_per_position)  # every step
    assert theirs.counts.num_drafts == ours.counts.num_drafts
    assert theirs.counts.num_accepted_tokens == ours.counts.num_accepted_tokens
    assert list(theirs.counts.accepted_per_position) == list(ours.counts.accepted_per_position)
