"""MLPSpeculatorConfig and IndependentSpeculatorConfig: defaults, config.json, registry reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from speculators_vllm016.config import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
from speculators_vllm016.models.independent import IndependentSpeculatorConfig
from speculators_vllm016.models.mlp import MLPSpeculatorConfig
from speculators_vllm016.proposals.greedy import GreedyTokenProposalConfig


def speculators_config(algorithm: str) -> SpeculatorsConfig:
    return SpeculatorsConfig(
        algorithm=algorithm,
        proposal_methods=[GreedyTokenProposalConfig()],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path="meta-llama/x", architectures=["LlamaForCausalLM"]),
    )


def test_mlp_defaults() -> None:
    config = MLPSpeculatorConfig()
    assert config.speculators_model_type == "mlp"
    assert config.architectures == ["MLPSpeculator"]
    assert config.inputs == ["input_embeddings", "hidden_states[-1]"]
    assert config.inputs_hidden_states_normalized is False
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (4096, 4096, 128256)
    assert (config.num_layers, config.tie_weights) == (5, True)
    assert config.to_dict()["torch_dtype"] == "bfloat16"


def test_mlp_roundtrip(tmp_path: Path) -> None:
    config = MLPSpeculatorConfig(
        num_layers=3,
        hidden_size=256,
        torch_dtype="float16",
        speculators_config=speculators_config("mlp"),
    )
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["speculators_model_type"] == "mlp"
    assert saved["torch_dtype"] == "float16" and saved["num_layers"] == 3
    loaded = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert type(loaded) is MLPSpeculatorConfig
    assert (loaded.num_layers, loaded.hidden_size) == (3, 256)
    assert loaded.to_dict()["torch_dtype"] == "float16"


def test_independent_keeps_model_fields(tmp_path: Path) -> None:
    draft = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
    config = IndependentSpeculatorConfig.from_pretrained_config(
        draft, speculators_config("independent")
    )
    as_dict = config.to_dict()
    assert as_dict["model_type"] == "llama"  # the draft's, so it still loads as a Llama
    assert as_dict["speculators_model_type"] == "independent"
    assert "_model_type" not in as_dict
    assert as_dict["hidden_size"] == 128 and as_dict["num_hidden_layers"] == 2
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["vocab_size"] == 512
    assert saved["speculators_config"]["algorithm"] == "independent"
    loaded = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert type(loaded) is IndependentSpeculatorConfig
    assert loaded.to_dict()["model_type"] == "llama" and loaded.hidden_size == 128
    with pytest.raises(TypeError):
        IndependentSpeculatorConfig.from_pretrained_config(
            {"hidden_size": 1}, speculators_config("x")
        )
