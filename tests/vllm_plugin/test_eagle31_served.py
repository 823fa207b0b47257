"""EAGLE-3.1 and a TorchSpec draft served by vLLM 0.16's own speculative decoding on its CPU
build (the plugin's `cpu_speculation`): lossless, and vLLM's acceptance counters equal to the `hf`
engine's (`speculative_generate`) on the same draft, prompts and greedy decoding.

The drafts are "logit lens" drafts of the tiny Llama (tests/evaluate/drafts.py): right often,
not always. The 3.1 one has `fc_norm` (weights away from one, so the fused state's scale per
feature changes what it proposes) and `norm_output` (its decoder layer reduced to the residual,
so every later step reads exactly what the step before handed on: the final norm's output, or
with the bug the state before it; its final norm's weight is not flat, so the two propose other
tokens). The TorchSpec one is the 3.0
logit lens written in TorchSpec's export layout with its own fused-layer numbering (output of
layer i), converted by `speculators convert`: read with the wrong numbering it fuses other
layers, which shows as lower acceptance (checked with the `hf` engine, no second vLLM start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from tests.evaluate.drafts import VOCAB, logit_lens_draft
from tests.vllm_plugin.served import assert_same_counts, hf_speculative, serve

pytestmark = pytest.mark.engine

K = 3
NEW_TOKENS = 16
LENGTHS = [5, 37, 12, 23]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


def _serve(target: Path, draft: Path, prompts: list[list[int]]):
    """vLLM's greedy speculative decoding of `prompts` and its acceptance counters."""
    config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    served = serve(
        target,
        config,
        prompts,
        NEW_TOKENS,
        passes=1,
        prefix_caching=None,
        max_model_len=256,
        max_num_seqs=None,
        async_scheduling=False,
    )
    return served.first, served.counts


def _hf(target: Path, draft: Path, prompts: list[list[int]]):
    result = hf_speculative(target, draft, prompts, NEW_TOKENS, K)
    return result.outputs, result.counts


def _lens(target: Path) -> Eagle3DraftModel:
    """The logit lens of layer 3's input, fusing three distinct layers (vLLM's Llama captures a
    repeated id once)."""
    return logit_lens_draft(str(target), "LlamaForCausalLM", (1, 2, 3), K)


@pytest.fixture(scope="module")
def draft31(tiny_llama, tmp_path_factory) -> Path:
    draft = _lens(tiny_llama)
    config = draft.config
    config.fc_norm, config.norm_output = True, True
    shell = Eagle3DraftModel(config)
    state = draft.state_dict()
    generator = torch.Generator().manual_seed(3)
    for index in range(3):
        state[f"fc_norm.{index}.weight"] = 0.8 + 0.4 * torch.rand(256, generator=generator)
    # A final norm whose weight is not flat: normed twice (norm_output) is then not normed once.
    state["norm.weight"] = state["norm.weight"] * (0.7 + 0.6 * torch.rand(256, generator=generator))
    shell.load_state_dict(state, strict=False)
    folder = tmp_path_factory.mktemp("draft31")
    shell.save_pretrained(folder)
    return folder


def test_eagle31_served_on_cpu_is_lossless_and_accepts_as_the_hf_engine(tiny_llama, draft31):
    prompts = _prompts()
    served, served_counts = _serve(tiny_llama, draft31, prompts)
    hf, hf_counts = _hf(tiny_llama, draft31, prompts)
    assert served == hf  # the hf engine's output is the verifier's greedy output
    assert_same_counts(served_counts, hf_counts)


def _torchspec_folder(ours: Path, out: Path, post_layer_ids: list[int]) -> Path:
    """`ours` in TorchSpec's export layout (`midlayer.*`, `_torchspec_version`)."""
    out.mkdir(parents=True)
    layer = json.loads((ours / "config.json").read_text())["transformer_layer_config"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **{k: layer[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads")},
        **{k: layer[k] for k in ("num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size")},
        "max_position_embeddings": layer["max_position_embeddings"],
        "draft_vocab_size": VOCAB,
        "torch_dtype": "float32",
        "_torchspec_version": "0.1.0",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": post_layer_ids},
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = {
        name.replace("layers.0.", "midlayer."): tensor
        for name, tensor in load_file(ours / "model.safetensors").items()
    }
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_a_converted_torchspec_draft_serves_with_its_fused_layers(tiny_llama, tmp_path):
    from speculators_vllm016.convert.entrypoints import convert_model

    ours = tmp_path / "ours"  # fuses vLLM's layers [1, 2, 3]: the third one is what it reads
    _lens(tiny_llama).save_pretrained(ours)
    converted = tmp_path / "converted"
    convert_model(
        str(_torchspec_folder(ours, tmp_path / "torchspec", [0, 1, 2])),
        str(tiny_llama),
        "eagle3",
        str(converted),
    )
    assert json.loads((converted / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"
    ] == [1, 2, 3]
    prompts = _prompts()
    served, served_counts = _serve(tiny_llama, converted, prompts)
    hf, hf_counts = _hf(tiny_llama, ours, prompts)
    assert served == hf
    assert_same_counts(served_counts, hf_counts)
    # The same draft read in the wrong numbering ([0, 1, 2] as vLLM's ids) accepts less.
    wrong = tmp_path / "wrong"
    convert_model(
        str(tmp_path / "torchspec"),
        str(tiny_llama),
        "eagle3",
        str(wrong),
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
    )
    _, wrong_counts = _hf(tiny_llama, wrong, prompts)
    assert wrong_counts.num_accepted_tokens < hf_counts.num_accepted_tokens
