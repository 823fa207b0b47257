"""Whether the installed vLLM can serve an EAGLE-3 draft for a target, said at start-up.

The verdicts use the facts read from the real installed vLLM 0.16 (its sources, not a mock);
only the plugin's on/off switch and its installation are varied by hand.
"""

from __future__ import annotations

import dataclasses

import pytest

from speculators_vllm016.utils.eagle3_serving import (
    eagle3_serving_verdict,
    installed_vllm_facts,
    plugin_enabled,
    serving_line,
    target_identity,
)
from speculators_vllm016.utils.vllm_sources import (
    class_implements,
    eagle3_target_types,
    registered_model_class,
    vllm_package_dir,
)

LLAMA = (["LlamaForCausalLM"], "llama")
DEEPSEEK_V3 = (["DeepseekV3ForCausalLM"], "deepseek_v3")
KIMI_K2 = (["DeepseekV3ForCausalLM"], "kimi_k2")  # Kimi-K2's config.json
KIMI_K25 = (["KimiK25ForConditionalGeneration"], "deepseek_v3")  # the wrapper's text model
GEMMA3 = (["Gemma3ForCausalLM"], "gemma3_text")
GEMMA3_WRAPPER = (["Gemma3ForConditionalGeneration"], "gemma3_text")


def verdict(target, plugin_on=True, installed=True):
    architectures, model_type = target
    facts = installed_vllm_facts(architectures)
    facts = dataclasses.replace(facts, plugin_installed=installed)
    return eagle3_serving_verdict(architectures, model_type, facts, plugin_on), facts


def test_llama_is_served_by_vllm_itself():
    for plugin_on in (True, False):
        result, facts = verdict(LLAMA, plugin_on)
        assert result.servable and not result.via_plugin and not result.causes
        assert (
            serving_line(result, facts) == "vLLM 0.16.0 can serve an EAGLE-3 draft for this target"
        )


@pytest.mark.parametrize(
    "target", [DEEPSEEK_V3, KIMI_K2, KIMI_K25], ids=["deepseek_v3", "kimi_k2", "kimi_k25"]
)
def test_deepseek_and_kimi_need_the_plugin(target):
    result, facts = verdict(target, plugin_on=True)
    assert result.servable and result.via_plugin
    assert "with this package's plugin" in serving_line(result, facts)

    result, facts = verdict(target, plugin_on=False)
    assert not result.servable
    line = serving_line(result, facts)
    assert (
        f"text model type '{target[1]}' is not in vLLM 0.16.0's EAGLE-3 list (llama, qwen" in line
    )
    assert f"model class for {target[0][0]} lacks SupportsEagle3" in line
    assert "switched off (SPECULATORS_VLLM_PLUGIN=0" in line

    result, _ = verdict(target, plugin_on=True, installed=False)
    assert not result.servable
    assert any("entry point is not installed" in cause for cause in result.causes)


@pytest.mark.parametrize("target", [GEMMA3, GEMMA3_WRAPPER], ids=["gemma3", "gemma3_wrapper"])
def test_gemma3_is_refused_with_both_causes(target):
    result, facts = verdict(target)
    assert not result.servable and not result.via_plugin
    assert result.causes == (
        "text model type 'gemma3_text' is not in vLLM 0.16.0's EAGLE-3 list "
        "(llama, qwen, minicpm, gpt_oss, hunyuan_vl, hunyuan_v1_dense, afmoe)",
        f"vLLM 0.16.0's model class for {target[0][0]} lacks SupportsEagle3",
    )
    assert serving_line(result, facts).startswith(
        "vLLM 0.16.0 cannot serve an EAGLE-3 draft for this target: text model type 'gemma3_text'"
    )


def test_an_architecture_vllm_does_not_know():
    result, _ = verdict((["NoSuchForCausalLM"], "llama"))
    assert result.causes == ("vLLM 0.16.0 has no model class for NoSuchForCausalLM",)


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, True),
        ({"SPECULATORS_VLLM_PLUGIN": "1"}, True),
        ({"SPECULATORS_VLLM_PLUGIN": "0"}, False),
        ({"SPECULATORS_VLLM_PLUGIN": "off"}, False),
        ({"VLLM_PLUGINS": "lora_filesystem_resolver"}, False),
        ({"VLLM_PLUGINS": "lora_filesystem_resolver,speculators_eagle3"}, True),
    ],
)
def test_plugin_switch(environ, enabled):
    assert plugin_enabled(environ) is enabled


def test_target_identity_reads_the_text_model_inside_a_wrapper():
    kimi = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168},
    }
    assert target_identity(kimi) == (["KimiK25ForConditionalGeneration"], "deepseek_v3")
    assert target_identity({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) == LLAMA


def test_source_reading_agrees_with_importing_vllm():
    """The static reading of vLLM's files says what vLLM's own objects say."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    from speculators_vllm016.vllm_plugin.speculative_types import eagle3_model_types_in

    root = vllm_package_dir()
    shipped = eagle3_target_types(root)
    compiled = eagle3_model_types_in(SpeculativeConfig._verify_args.__code__)
    assert compiled[: len(shipped)] == shipped  # the plugin may have appended its three
    for arch in ["LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM"]:
        module, name = registered_model_class(root, arch)
        assert ModelRegistry.models[arch].module_name == f"vllm.model_executor.models.{module}"
        imported = ModelRegistry._try_load_model_cls(arch)
        assert class_implements(root, module, name, "SupportsEagle3") is supports_eagle3(
            imported
        ), arch
