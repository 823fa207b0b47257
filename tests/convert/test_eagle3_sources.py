"""`speculators convert` reads the EAGLE-3 drafts of other tools (TorchSpec, Model Optimizer)
and upstream speculators 0.7's as they are: each tool's fused-layer numbering mapped into ours
by its one documented rule, the tensors kept bit for bit, and vLLM 0.16 (with the plugin) loads
every weight of the result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators_vllm016.convert.eagle3_sources import (
    detect_source,
    post_layer_ids_to_ours,
)
from speculators_vllm016.convert.entrypoints import convert_model
from speculators_vllm016.utils.errors import InvalidInputError
from tests.evaluate.drafts import build_draft
from tests.train.pretrained_drafts import (
    write_modelopt_draft,
    write_speculators07_draft,
    write_torchspec_draft,
)
from tests.vllm_compat.harness import load_eagle3_into_vllm, shutdown_vllm_distributed

KIMI_K25 = {"text_config": {"num_hidden_layers": 61, "vocab_size": 163840}}


@pytest.fixture(scope="module", autouse=True)
def _plugin_and_teardown():
    from speculators_vllm016.vllm_plugin import register

    register()
    yield
    shutdown_vllm_distributed()


@pytest.fixture(scope="module")
def ours(tiny_llama, tmp_path_factory) -> Path:
    """An untrained draft of the tiny Llama (draft vocabulary 64) saved by our model."""
    folder = tmp_path_factory.mktemp("ours")
    build_draft(str(tiny_llama), seed=4, draft_vocab=64).save_pretrained(folder)
    return folder


def test_each_tool_is_recognized_from_its_config():
    assert detect_source({"_torchspec_version": "0.1", "model_type": "llama"}) == "torchspec"
    assert detect_source({"eagle_config": {"use_mtp_layernorm": False}}) == "modelopt"
    assert detect_source({"draft_vocab_size": 32000}) == "research"


def test_output_of_layer_ids_become_input_of_layer_ids():
    # TorchSpec's and Model Optimizer's default on Kimi-K2.5: [1, 29, 57] -> vLLM's [2, 30, 58]
    assert post_layer_ids_to_ours(None, KIMI_K25, "torchspec") == [2, 30, 58]
    assert post_layer_ids_to_ours([1, 29, 57], KIMI_K25, "modelopt") == [2, 30, 58]
    # Model Optimizer's Kimi-K2.5 recipe names vLLM's ids: read as outputs of layers, 61 is past
    # the last layer. Refused, with the fix named.
    with pytest.raises(InvalidInputError, match="give the fused layers explicitly"):
        post_layer_ids_to_ours([2, 30, 58, 61], KIMI_K25, "modelopt")


def test_modelopt_four_id_lists_are_its_vllm_recipes_fused_layers_then_the_final_layer():
    from speculators_vllm016.convert.eagle3_sources.modelopt import modelopt_layer_ids

    # Kimi-K2.5's recipe: fused 2, 30, 58 (vLLM's numbering, = TorchSpec's post-layer [1, 29,
    # 57]); 61 = N, the last layer's output before the final norm (60 without vLLM's fix).
    assert modelopt_layer_ids([2, 30, 58, 61], KIMI_K25) == [2, 30, 58]
    assert modelopt_layer_ids([2, 30, 58, 60], KIMI_K25) == [2, 30, 58]
    assert modelopt_layer_ids([1, 29, 57], KIMI_K25) == [2, 30, 58]  # three: its HF hooks
    with pytest.raises(InvalidInputError, match="must end in the final layer"):
        modelopt_layer_ids([2, 30, 58, 59], KIMI_K25)
    with pytest.raises(InvalidInputError, match="not increasing"):
        modelopt_layer_ids([30, 2, 58, 61], KIMI_K25)


def _converted(tmp_path: Path, draft: Path, verifier: Path, **kwargs) -> Path:
    out = tmp_path / "converted"
    convert_model(str(draft), str(verifier), "eagle3", str(out), validate_device="cpu", **kwargs)
    return out


@pytest.mark.parametrize("source", ["torchspec", "modelopt"])
def test_a_tools_draft_converts_bit_for_bit_and_vllm_loads_it(source, ours, tiny_llama, tmp_path):
    import json

    writer = write_torchspec_draft if source == "torchspec" else write_modelopt_draft
    draft = writer(ours, tmp_path / source, [0, 1, 2])
    out = _converted(tmp_path, draft, tiny_llama)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # outputs of 0, 1, 2
    assert config["norm_before_residual"] is False
    stored = load_file(draft / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    for name, tensor in stored.items():
        assert torch.equal(converted[name.replace("midlayer.", "layers.0.")], tensor), name
    original = load_file(ours / "model.safetensors")
    assert torch.equal(converted["t2d"], original["t2d"])  # Model Optimizer ships d2t only
    assert torch.equal(converted["embed_tokens.weight"].float(), original["embed_tokens.weight"])
    result = load_eagle3_into_vllm(out, tiny_llama)
    assert not result.missing and not result.unexpected and result.ignored <= {"t2d"}


def test_an_explicit_id_list_wins_over_the_tools_mapping(ours, tiny_llama, tmp_path):
    import json

    draft = write_modelopt_draft(ours, tmp_path / "modelopt", [2, 30, 58])  # a 61-layer target's
    with pytest.raises(InvalidInputError, match="do not fit a 4-layer target"):
        _converted(tmp_path, draft, tiny_llama)
    out = _converted(tmp_path, draft, tiny_llama, eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
    ]


def test_a_speculators07_draft_needs_no_conversion_and_vllm_loads_its_norm(
    ours, tiny_llama, tmp_path
):
    draft = write_speculators07_draft(ours, tmp_path / "v07")
    with pytest.raises(InvalidInputError, match="already in the speculators format"):
        _converted(tmp_path, draft, tiny_llama)
    result = load_eagle3_into_vllm(draft, tiny_llama)
    assert not result.missing and not result.unexpected
    assert "model.input_norm.weight" in result.loaded and result.model.norm_output
    stored = load_file(draft / "model.safetensors")["input_norm.weight"]
    assert torch.equal(result.model.model.input_norm.weight.to(stored.dtype), stored)


def test_a_draft_without_embeddings_takes_them_from_a_wrapped_verifier(
    ours, tiny_kimi_k25, tmp_path
):
    """Model Optimizer ships no embeddings; against the Kimi-K2.5 wrapper (its language model's
    tensors under `language_model.`) the converter finds them there."""
    from speculators_vllm016.utils.verifier_weights import read_verifier_weights

    draft = write_modelopt_draft(ours, tmp_path / "modelopt", [0, 1, 2])
    out = _converted(tmp_path, draft, tiny_kimi_k25)
    embeddings = load_file(out / "model.safetensors")["embed_tokens.weight"].float()
    assert torch.equal(embeddings, read_verifier_weights(str(tiny_kimi_k25)).embeddings.float())
