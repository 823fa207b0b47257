"""Speculator configs: serialization to and from the 0.3.0 layout, and dispatch on type."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from speculators_vllm016.config import (
    SpeculatorModelConfig,
    SpeculatorsConfig,
    TokenProposalConfig,
    VerifierConfig,
    reload_and_populate_configs,
)
from speculators_vllm016.proposals import GreedyTokenProposalConfig


def test_verifier_config_from_a_model_config():
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    config._name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
    verifier = VerifierConfig.from_config(config)
    assert verifier.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert verifier.architectures == ["LlamaForCausalLM"]
    assert VerifierConfig.from_config(config, name_or_path=None).name_or_path is None


def test_speculators_config_round_trip_dispatches_proposals():
    reload_and_populate_configs()
    config = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path="v", architectures=["LlamaForCausalLM"]),
    )
    dumped = config.model_dump()
    assert dumped["proposal_methods"] == [
        {
            "proposal_type": "greedy",
            "speculative_tokens": 4,
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }
    ]
    again = SpeculatorsConfig.model_validate(dumped)
    assert isinstance(again.proposal_methods[0], GreedyTokenProposalConfig)
    assert again == config
    assert TokenProposalConfig.registry["greedy"] is GreedyTokenProposalConfig


def test_speculator_config_needs_a_model_type(tmp_path):
    with pytest.raises(ValueError, match="speculators_model_type"):
        SpeculatorModelConfig.from_dict({"draft_vocab_size": 3})
    LlamaConfig().save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="not a speculator checkpoint"):
        SpeculatorModelConfig.from_pretrained(tmp_path)


def test_from_dict_dispatches_to_the_registered_class():
    config = SpeculatorModelConfig.from_dict(
        {
            "speculators_model_type": "eagle3",
            "draft_vocab_size": 64,
            "transformer_layer_config": {"model_type": "llama", "hidden_size": 128},
        }
    )
    assert type(config).__name__ == "Eagle3SpeculatorConfig"
    assert config.transformer_layer_config.hidden_size == 128
    assert config.target_vocab_size == config.transformer_layer_config.vocab_size
