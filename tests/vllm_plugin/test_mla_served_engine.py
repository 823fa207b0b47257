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

from speculators_vllm016.evaluate.speculative import speculative_generate
from speculators_vllm016.evaluate.vllm_engine import counts_from_metrics
from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.models.verifier_lm import load_verifier_lm
from speculators_vllm016.train.jobs.draft_build import build_draft_config
from speculators_vllm016.utils.verifier_weights import read_verifier_weights

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


def served(target: Path, draft: Path, requests: list[list[int]]) -> SimpleNamespace:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculators_vllm016.data_generation.cpu_defaults import cpu_defaults_applied
    from speculators_vllm016.data_generation.engine_setup import TEXT_ONLY_MODALITIES

    config = json.loads((target / "config.json").read_text())
    with cpu_defaults_applied(1, config):
        llm = LLM(
            model=str(target),
            speculative_config={
                "method": "eagle3",
                "model": str(draft),
                "num_speculative_tokens": K,
            },
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=4,
            # Kimi-K2.5: text only, so vLLM never builds the media processor's profiling inputs
            limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),
            disable_log_stats=False,
            seed=0,
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False
        )
        counts = counts_from_metrics(llm.get_metrics(), K)
    finally:
        del llm
        gc.collect()
    return SimpleNamespace(outputs=[list(r.outputs[0].token_ids) for r in results], counts=counts)


def reference(verifier: Path, draft: Path, requests: list[list[int]]) -> SimpleNamespace:
    """What `eval --engine hf` computes: our draft with transformers' verifier, greedy."""
    from speculators_vllm016.model import SpeculatorModel

    model = load_verifier_lm(str(verifier), torch.float32, False).eval()
    mla = SpeculatorModel.from_pretrained(str(draft), verifier_attachment_mode="detached")
    mla = mla.float().eval()
    mla.load_verifier_weights(str(verifier))
    result = speculative_generate(model, mla, requests, MAX_TOKENS, K, eos_token_ids=[])
    return SimpleNamespace(outputs=result.outputs, counts=result.counts)


@pytest.mark.parametrize("target_name", ["tiny_deepseek_v3", "tiny_kimi_k25"])
def test_served_mla_draft_is_lossless_and_accepts_as_eval_hf(target_name, request, tmp_path):
    target = request.getfixturevalue(target_name)
    draft = lens_mla_draft(target, tmp_path / "draft")
    requests = prompts()
    ours = reference(target, draft, requests)
    theirs = served(target, draft, requests)
    assert theirs.outputs == ours.outputs  # vLLM with the draft = the verifier's greedy tokens
    assert 0 < ours.counts.num_accepted_tokens < ours.counts.num_draft_tokens
    assert all(accepted > 0 for accepted in ours.counts.accepted_per_position)  # every step
    assert theirs.counts.num_drafts == ours.counts.num_drafts
    assert theirs.counts.num_accepted_tokens == ours.counts.num_accepted_tokens
    assert list(theirs.counts.accepted_per_position) == list(ours.counts.accepted_per_position)
