"""EAGLE-3.1 and a converted Model Optimizer draft served on the DeepSeek-V3 family by vLLM 0.16's
own speculative decoding on its CPU build (#47 item 3): lossless, and vLLM's acceptance counters
equal to the `hf` engine's (`speculative_generate`) on the same draft, prompts and greedy decoding.
One engine per draft and target (vLLM serves one draft per target engine): four engines in all,
the converted TorchSpec and Model Optimizer drafts on the Kimi-K2.5 wrapper being the same files
(one engine, `ServedOnce`).

Both drafts are logit lenses of the target's last layer (tests/evaluate/drafts.py) fusing aux ids
[1, 2, 3] of the 3-layer tiny DeepSeek-V3: id 3 is the last layer's output before the final
norm, so served and `hf` agree only if both read that state (`models/verifier_states.py`).
- EAGLE-3.1 (`fc_norm` with weights away from one, `norm_output` with a final norm that is not
  flat) on the tiny DeepSeek-V3 and the tiny Kimi-K2.5 wrapper, both held: served without either,
  both cases fail. The lens draft's layer is the identity on its residual, so a later step
  proposes from the state the step before handed on: the same token again without `norm_output`,
  the lens of the normed state with it. On the random prompts the tiny DeepSeek-V3 hardly ever
  repeats a token and later positions are almost never accepted either way; the test adds
  prompts of one token repeated, where it does, and the two propose differently (the `hf`
  engine's counters [16, 9, 2] with `norm_output`, [16, 10, 4] without).
- A Model Optimizer export recording its Kimi-K2.5 recipe's four-id list in the tiny target's
  terms, [1, 2, 3, 3] (fused layers in vLLM's numbering, then N: the final layer), converted by
  `speculators convert` against the tiny Kimi-K2.5 wrapper and served on it. Read with the other
  numbering (output of layer i, ids + 1) the list does not fit the target and is refused; the
  ids one lower (the fused state one layer earlier) change what the `hf` engine accepts.
- A TorchSpec export (its own numbering, output of layer i) converted and served on the tiny
  DeepSeek-V3 and the Kimi-K2.5 wrapper, accepting as the original draft on the `hf` engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from tests.evaluate.drafts import logit_lens_draft
from tests.train.pretrained_drafts import _as_midlayer, _llama_fields
from tests.vllm_plugin.served import ServedOnce, assert_same_counts, hf_speculative

pytestmark = pytest.mark.engine

K = 3
NEW_TOKENS = 24
LENGTHS = [9, 17, 26, 40, 12, 30]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


def _repeating_prompts() -> list[list[int]]:
    """One token repeated: the target goes on repeating, so the lens draft's later positions are
    accepted, and they depend on what its step hands on (`norm_output`)."""
    return [[token] * n for token, n in zip([17, 95, 204, 300, 418, 6], LENGTHS, strict=True)]


@pytest.fixture(scope="module")
def served_once() -> ServedOnce:
    """One engine per (target, draft bytes): the Kimi-K2.5 wrapper's converted TorchSpec draft is
    the converted Model Optimizer draft, file for file, and is served once for both tests."""
    return ServedOnce()


def _serve(served_once: ServedOnce, target: Path, draft: Path, prompts: list[list[int]]):
    """vLLM's greedy speculative decoding of `prompts` and its acceptance counters."""
    config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    served = served_once(
        target, config, prompts, NEW_TOKENS, passes=1, prefix_caching=False, max_model_len=256
    )
    return served.first, served.counts


def _hf(target: Path, draft: Path, prompts: list[list[int]]):
    result = hf_speculative(target, draft, prompts, NEW_TOKENS, K)
    return result.outputs, result.counts


def _lens(target: Path, aux_ids=(1, 2, 3)) -> Eagle3DraftModel:
    architecture = json.loads((target / "config.json").read_text())["architectures"][0]
    return logit_lens_draft(str(target), architecture, aux_ids, K)


@pytest.mark.parametrize("target_fixture", ["tiny_deepseek_v3", "tiny_kimi_k25"])
def test_eagle31_served_on_the_deepseek_family_is_lossless_and_accepts_as_hf(
    target_fixture, request, tmp_path, served_once
):
    target = request.getfixturevalue(target_fixture)
    draft = _lens(target)
    config = draft.config
    config.fc_norm, config.norm_output = True, True
    shell = Eagle3DraftModel(config)
    state = draft.state_dict()
    generator = torch.Generator().manual_seed(3)
    hidden = config.transformer_layer_config.hidden_size
    for index in range(3):
        state[f"fc_norm.{index}.weight"] = 0.8 + 0.4 * torch.rand(hidden, generator=generator)
    norm = state["norm.weight"]
    state["norm.weight"] = norm * (0.7 + 0.6 * torch.rand(hidden, generator=generator))
    shell.load_state_dict(state, strict=False)
    shell.save_pretrained(tmp_path / "draft31")
    prompts = _prompts() + _repeating_prompts()
    served, served_counts = _serve(served_once, target, tmp_path / "draft31", prompts)
    hf, hf_counts = _hf(target, tmp_path / "draft31", prompts)
    assert served == hf
    assert_same_counts(served_counts, hf_counts)


def _modelopt_folder(ours: Path, out: Path, recorded: list[int]) -> Path:
    """`ours` as Model Optimizer exports it: `midlayer.*`, no embeddings, no `t2d`, its
    `eagle_config` recording `recorded`."""
    out.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(ours),
        "draft_vocab_size": 512,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": recorded,
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": False,
            "use_mtp_layernorm": False,
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = _as_midlayer(load_file(ours / "model.safetensors"))
    for dropped in ("embed_tokens.weight", "t2d"):
        weights.pop(dropped)
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_a_modelopt_kimi_recipe_draft_converts_and_serves_on_the_kimi_wrapper(
    tiny_kimi_k25, tmp_path, served_once
):
    from speculators_vllm016.convert.entrypoints import convert_model
    from speculators_vllm016.utils.errors import InvalidInputError

    ours = tmp_path / "ours"
    _lens(tiny_kimi_k25).save_pretrained(ours)
    exported = _modelopt_folder(ours, tmp_path / "modelopt", [1, 2, 3, 3])
    converted = tmp_path / "converted"
    convert_model(str(exported), str(tiny_kimi_k25), "eagle3", str(converted))
    config = json.loads((converted / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    # Read as outputs of layers (the three-id rule), the list does not fit a 3-layer target.
    post_layer = _modelopt_folder(ours, tmp_path / "post_layer", [1, 2, 3])
    with pytest.raises(InvalidInputError, match="do not fit a 3-layer target"):
        convert_model(str(post_layer), str(tiny_kimi_k25), "eagle3", str(tmp_path / "x"))

    prompts = _prompts()
    served, served_counts = _serve(served_once, tiny_kimi_k25, converted, prompts)
    hf, hf_counts = _hf(tiny_kimi_k25, converted, prompts)
    assert served == hf
    assert_same_counts(served_counts, hf_counts)
    # One layer off (the fused states one layer earlier): other acceptance.
    shifted = tmp_path / "shifted"
    convert_model(
        str(exported),
        str(tiny_kimi_k25),
        "eagle3",
        str(shifted),
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
    )
    _, shifted_counts = _hf(tiny_kimi_k25, shifted, prompts)
    assert shifted_counts.accepted_per_position != hf_counts.accepted_per_position


@pytest.mark.parametrize("target_fixture", ["tiny_deepseek_v3", "tiny_kimi_k25"])
def test_a_converted_torchspec_draft_serves_on_the_deepseek_family(
    target_fixture, request, tmp_path, served_once
):
    """TorchSpec's export layout and numbering (output of layer i: [0, 1, 2]), converted into
    ours ([1, 2, 3], id 3 the last layer's output) and served: as the original on `hf`."""
    tiny_deepseek_v3 = request.getfixturevalue(target_fixture)  # either target of the family
    from speculators_vllm016.convert.entrypoints import convert_model
    from tests.vllm_plugin.test_eagle31_served import _torchspec_folder

    ours = tmp_path / "ours"
    _lens(tiny_deepseek_v3).save_pretrained(ours)
    converted = tmp_path / "converted"
    exported = _torchspec_folder(ours, tmp_path / "torchspec", [0, 1, 2])
    convert_model(str(exported), str(tiny_deepseek_v3), "eagle3", str(converted))
    config = json.loads((converted / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    prompts = _prompts()
    served, served_counts = _serve(served_once, tiny_deepseek_v3, converted, prompts)
    hf, hf_counts = _hf(tiny_deepseek_v3, ours, prompts)
    assert served == hf
    assert_same_counts(served_counts, hf_counts)
