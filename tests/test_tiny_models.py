"""The package keeps only the demo's tiny Llama; the other test checkpoints are built in tests/."""

from __future__ import annotations

import json

import speculators_vllm016.tiny_models as package_models
from tests import tiny_models as test_models


def test_the_package_holds_no_test_fixture_builders():
    builders = {name for name in dir(package_models) if name.startswith("build_tiny_")}
    assert builders == {"build_tiny_llama"}
    assert not [name for name in dir(package_models) if "KIMI" in name.upper()]
    assert set(test_models.__all__) == {
        "THINKING_TEMPLATE",
        "copy_with_thinking_template",
        "build_taught_tiny_deepseek_v3",
        "build_tiny_deepseek_v3",
        "build_tiny_kimi_k25",
        "build_tiny_qwen3",
    }


def test_a_test_checkpoint_is_built_with_the_package_helpers(tmp_path):
    path = test_models.build_tiny_qwen3(tmp_path / "qwen3", num_hidden_layers=1)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == 1
    assert (path / "model.safetensors").stat().st_size > 0
    tokenizer = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in json.dumps(tokenizer)
