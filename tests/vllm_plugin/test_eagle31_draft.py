"""An EAGLE-3.1 draft from `speculators train --fc-norm --norm-output`, as vLLM 0.16 builds it
through the plugin (no engine): the config keys reach vLLM's draft config, vLLM builds the
plugin's `Eagle31LlamaForCausalLM`, every weight loads (the per-state norms included), and its
fusion of the target's states equals ours on the same inputs. A 3.0 draft builds the same
parameters as vLLM's own class; a config that asks for norms its weights lack is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from speculators_vllm016.cli.train import main
from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from tests.training_fixtures import finished_checkpoints, train_args
from tests.vllm_compat.harness import (
    iter_checkpoint_tensors,
    load_eagle3_into_vllm,
    parse_with_vllm,
    shutdown_vllm_distributed,
)


@pytest.fixture(scope="module", autouse=True)
def _plugin_and_teardown():
    from speculators_vllm016.vllm_plugin import register

    register()  # what vLLM's load_general_plugins runs; parse_with_vllm alone would not
    yield
    shutdown_vllm_distributed()


@pytest.fixture(scope="module")
def draft31(tiny_llama: Path, training_data: Path, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("eagle31") / "ckpt"
    flags = ("--epochs", "1", "--max-steps", "2", "--fc-norm", "--norm-output")
    args = train_args(tiny_llama, training_data, save, *flags)
    assert main(args) == 0
    return save / finished_checkpoints(save)[-1]


def test_the_train_flags_reach_the_checkpoint(draft31):
    config = json.loads((draft31 / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (
        True,
        True,
        False,
    )
    names = set(dict(iter_checkpoint_tensors(draft31)))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    assert "input_norm.weight" not in names


def test_vllm_reads_the_eagle31_keys(draft31):
    parsed = parse_with_vllm(draft31)
    assert parsed["architectures"] == ["Eagle3LlamaForCausalLM"]
    hf = parsed["hf_config"]
    assert (hf["fc_norm"], hf["norm_output"], hf["norm_before_fc"]) == (True, True, False)


def test_vllm_builds_the_plugin_class_and_loads_every_weight(draft31, tiny_llama):
    from speculators_vllm016.vllm_plugin.eagle31_llama import Eagle31LlamaForCausalLM

    result = load_eagle3_into_vllm(draft31, tiny_llama)
    model = result.model
    assert type(model) is Eagle31LlamaForCausalLM and model.norm_output
    assert not result.missing and not result.unexpected
    assert result.ignored <= {"t2d"}
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= result.loaded
    saved = dict(iter_checkpoint_tensors(draft31))
    for index in range(3):
        assert torch.equal(
            model.model.fc_norm[index].weight.float(), saved[f"fc_norm.{index}.weight"].float()
        )


def test_vllms_fusion_equals_ours(draft31, tiny_llama):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    loaded = load_eagle3_into_vllm(draft31, tiny_llama)  # a float32 draft
    vllm_model, vllm_config = loaded.model, loaded.vllm_config
    with set_current_vllm_config(vllm_config):  # as vLLM's loader finishes a model
        draft_config = vllm_config.speculative_config.draft_model_config
        process_weights_after_loading(vllm_model, draft_config, torch.device("cpu"))
    ours = Eagle3DraftModel.from_pretrained(draft31).float().eval()
    states = torch.randn(7, 3 * 256, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        theirs = vllm_model.combine_hidden_states(states)
        mine = ours.fuse_aux_states(states)
        without_norms = ours.fc(states)
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(theirs, without_norms, atol=1e-2)


def test_an_eagle30_draft_builds_vllms_own_parameters(tiny_llama, tmp_path):
    from tests.vllm_compat.harness import write_reference_eagle3_checkpoint

    folder = write_reference_eagle3_checkpoint(tmp_path / "draft", tiny_llama)
    result = load_eagle3_into_vllm(folder, tiny_llama)
    model = result.model
    assert model.model.fc_norm is None and model.model.input_norm is None
    assert not model.norm_output
    assert not any("fc_norm" in n or "input_norm" in n for n in result.expected)
    assert not result.missing and not result.unexpected


def test_norms_the_config_asks_for_must_be_in_the_weights(draft31, tiny_llama, tmp_path):
    from safetensors.torch import save_file

    stripped = tmp_path / "stripped"
    shutil.copytree(draft31, stripped)
    tensors = {
        k: v for k, v in dict(iter_checkpoint_tensors(draft31)).items() if "fc_norm" not in k
    }
    for file in stripped.glob("*.safetensors*"):
        file.unlink()
    save_file(tensors, str(stripped / "model.safetensors"))
    result = load_eagle3_into_vllm(stripped, tiny_llama)
    assert any("fc_norm.0.weight" in error for error in result.unexpected.values())
