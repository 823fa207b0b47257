"""vLLM 0.16 parses our Eagle-3 checkpoints and loads all their weights into its draft (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from tests.vllm_compat.harness import (
    iter_checkpoint_tensors,
    load_eagle3_into_vllm,
    parse_with_vllm,
    reference_eagle3_tensor_shapes,
    shutdown_vllm_distributed,
    write_reference_eagle3_checkpoint,
)

DRAFT_VOCAB = 128
TARGET_VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def _vllm_distributed_teardown():
    yield
    shutdown_vllm_distributed()


@pytest.fixture(scope="module")
def reference_checkpoint(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_reference_eagle3_checkpoint(tmp_path_factory.mktemp("eagle3_ref"), tiny_llama)


@pytest.fixture(scope="module")
def library_checkpoint(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
    from speculators_vllm016.proposals import GreedyTokenProposalConfig
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            num_hidden_layers=1,
            vocab_size=TARGET_VOCAB,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
        ),
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(tiny_llama), architectures=["LlamaForCausalLM"]
            ),
        ),
    )
    # Frequencies that leave gaps, so d2t offsets are non-trivial.
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, TARGET_VOCAB, 3)}, DRAFT_VOCAB, TARGET_VOCAB
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("eagle3_lib")
    Eagle3DraftModel(config, t2d=t2d, d2t=d2t).save_pretrained(folder)
    return folder


def _check_parse(folder: Path, verifier: Path) -> None:
    parsed = parse_with_vllm(folder)
    assert parsed["method"] == "eagle3"
    assert parsed["num_speculative_tokens"] == 3
    assert parsed["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert parsed["draft_vocab_size"] == DRAFT_VOCAB
    assert parsed["vocab_size"] == TARGET_VOCAB
    assert parsed["hidden_size"] == 256
    assert parsed["norm_before_residual"] is False
    assert parsed["hf_config"]["num_hidden_layers"] == 1
    # vLLM captures the *input* of target layer i (`hidden_states + residual`, residual is None
    # before layer 0), so valid ids are 1 .. num_layers - 1; without the field vLLM falls back to
    # Llama's (2, n // 2, n - 3), which for the 4-layer verifier is (2, 2, 1).
    target_layers = json.loads((verifier / "config.json").read_text())["num_hidden_layers"]
    aux = parsed["eagle_aux_hidden_state_layer_ids"]
    assert aux is not None and len(aux) == 3
    assert all(1 <= layer < target_layers for layer in aux), aux


def _check_load(folder: Path, verifier: Path) -> None:
    result = load_eagle3_into_vllm(folder, verifier)
    expected, loaded = result
    assert result.unexpected == {}, f"vLLM rejected checkpoint tensors: {result.unexpected}"
    assert expected - loaded == set(), f"vLLM parameters left unloaded: {expected - loaded}"
    # t2d is dropped by vLLM on purpose; any other tensor that reaches no parameter is lost.
    assert result.ignored <= {"t2d"}, f"checkpoint tensors vLLM silently dropped: {result.ignored}"

    # d2t keeps its meaning: vLLM scatters draft logit i to target id i + d2t[i].
    tensors = dict(iter_checkpoint_tensors(folder))
    model = result.model
    assert torch.equal(model.draft_id_to_target_id.data, tensors["d2t"])
    targets = torch.arange(DRAFT_VOCAB) + model.draft_id_to_target_id.data
    if "t2d" in tensors:
        assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), targets)
    assert model.lm_head.weight.shape == (DRAFT_VOCAB, 256)
    assert torch.equal(model.lm_head.weight.data, tensors["lm_head.weight"])
    assert torch.equal(model.model.fc.weight.data, tensors["fc.weight"])


def _shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in iter_checkpoint_tensors(folder)}


def test_reference_checkpoint_layout(reference_checkpoint: Path) -> None:
    shapes = _shapes(reference_checkpoint)
    assert shapes == reference_eagle3_tensor_shapes()


def test_reference_checkpoint_parses(reference_checkpoint: Path, tiny_llama: Path) -> None:
    _check_parse(reference_checkpoint, tiny_llama)


def test_reference_checkpoint_loads_into_vllm(reference_checkpoint: Path, tiny_llama: Path) -> None:
    _check_load(reference_checkpoint, tiny_llama)


def test_library_checkpoint_matches_reference_layout(library_checkpoint: Path) -> None:
    shapes = _shapes(library_checkpoint)
    planned = reference_eagle3_tensor_shapes()
    assert set(shapes) == set(planned), (
        f"extra: {set(shapes) - set(planned)}, absent: {set(planned) - set(shapes)}"
    )
    for name, (shape, dtype) in planned.items():
        assert shapes[name][0] == shape, name
        saved_dtype = shapes[name][1]
        assert saved_dtype == dtype or (dtype.is_floating_point and saved_dtype.is_floating_point)


def test_library_checkpoint_parses(library_checkpoint: Path, tiny_llama: Path) -> None:
    _check_parse(library_checkpoint, tiny_llama)


def test_library_checkpoint_loads_into_vllm(library_checkpoint: Path, tiny_llama: Path) -> None:
    _check_load(library_checkpoint, tiny_llama)


def test_harness_reports_renamed_and_absent_weights(
    reference_checkpoint: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """The harness itself: a misnamed tensor is reported as unexpected and its target as missing."""
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((reference_checkpoint / "config.json").read_text())
    tensors = dict(iter_checkpoint_tensors(reference_checkpoint))
    tensors["layers.0.hidden_layernorm.weight"] = tensors.pop("layers.0.hidden_norm.weight")
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))

    result = load_eagle3_into_vllm(broken, tiny_llama)
    assert set(result.unexpected) == {"layers.0.hidden_layernorm.weight"}
    assert result.missing == {
        "model.layers.0.hidden_norm.weight",
        "model.layers.0.mlp.gate_up_proj.weight",  # the up_proj half stays unwritten
    }
