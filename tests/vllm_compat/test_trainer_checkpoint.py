"""vLLM 0.16 parses and loads a checkpoint that `speculators train` wrote (CPU build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators_vllm016.cli.train import main
from tests.training_fixtures import DRAFT_VOCAB, LAYER_IDS, train_args
from tests.vllm_compat.harness import (
    iter_checkpoint_tensors,
    load_eagle3_into_vllm,
    parse_with_vllm,
    shutdown_vllm_distributed,
)


@pytest.fixture(scope="module", autouse=True)
def _vllm_distributed_teardown():
    yield
    shutdown_vllm_distributed()


@pytest.fixture(scope="module")
def trainer_checkpoint(tiny_llama: Path, training_data: Path, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("trainer_ckpt") / "ckpt"
    assert main(train_args(tiny_llama, training_data, save, "--epochs", "1")) == 0
    return save / "0"


def test_vllm_parses_the_trained_draft_with_its_aux_layer_ids(trainer_checkpoint, tiny_llama):
    parsed = parse_with_vllm(trainer_checkpoint)
    assert parsed["method"] == "eagle3"
    assert parsed["num_speculative_tokens"] == 3
    assert parsed["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert parsed["draft_vocab_size"] == DRAFT_VOCAB
    assert parsed["norm_before_residual"] is True
    # datagen captured the outputs of layers 0, 1, 2 (fused) and 3: vLLM must read the inputs
    # of layers 1, 2, 3, i.e. the same tensors.
    assert parsed["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS[:-1]]
    verifier = json.loads((tiny_llama / "config.json").read_text())
    assert parsed["hf_config"]["hidden_size"] == verifier["hidden_size"]


def test_vllm_loads_every_trained_weight(trainer_checkpoint, tiny_llama):
    result = load_eagle3_into_vllm(trainer_checkpoint, tiny_llama)
    expected, loaded = result
    assert result.unexpected == {}, f"vLLM rejected checkpoint tensors: {result.unexpected}"
    assert expected - loaded == set(), f"vLLM parameters left unloaded: {expected - loaded}"
    assert result.ignored <= {"t2d"}, f"checkpoint tensors vLLM dropped: {result.ignored}"
    tensors = dict(iter_checkpoint_tensors(trainer_checkpoint))
    model = result.model
    assert torch.equal(
        model.model.fc.weight.data.to(tensors["fc.weight"].dtype), tensors["fc.weight"]
    )
    assert torch.equal(model.draft_id_to_target_id.data, tensors["d2t"])
