"""Let `SpeculativeConfig(method="eagle3")` accept DeepSeek-V2/V3 and Kimi-K2(.5) targets.

vLLM 0.16's check is a list literal inside the pydantic model validator
`SpeculativeConfig._verify_args`, compiled into the function's constants. Pydantic holds that
very function object (in the class's validator and in every config that nests it), so neither
replacing the method nor subclassing the config reaches the check that `VllmConfig` runs. The
narrowest change that does is to give the function a copy of its own code whose one constant,
the tuple of accepted model types, has our three types appended: every line of vLLM's validator
still runs as shipped, and the error it raises for other models now lists the wider set.

If the constant is not there (another vLLM), nothing is patched and a warning says so.
"""

from __future__ import annotations

import logging
from types import CodeType

from speculators_vllm016.utils.eagle3_serving import PLUGIN_TEXT_MODEL_TYPES

__all__ = [
    "eagle3_model_types_in",
    "keep_mla_drafts_as_eagle3",
    "register_kimi_k2_config",
    "widen_eagle3_model_types",
]

# The MLA EAGLE-3 draft's architecture names (vLLM >= 0.18's, TorchSpec's).
MLA_DRAFT_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")

logger = logging.getLogger(__name__)


def eagle3_model_types_in(code: CodeType) -> tuple[str, ...] | None:
    """The accepted text model types, as the validator's compiled code holds them.

    Python compiles vLLM 0.16's list literal to one constant tuple of strings that starts with
    "llama". None unless exactly one such constant is there.
    """
    found = [
        value
        for value in code.co_consts
        if isinstance(value, tuple)
        and value
        and value[0] == "llama"
        and all(isinstance(item, str) for item in value)
    ]
    return found[0] if len(found) == 1 else None


def widen_eagle3_model_types() -> bool:
    """Append the plugin's text model types to vLLM's EAGLE-3 list; idempotent.

    Returns whether the list holds them afterwards.
    """
    from vllm.config.speculative import SpeculativeConfig

    validator = SpeculativeConfig._verify_args
    code = validator.__code__
    current = eagle3_model_types_in(code)
    if current is None:
        logger.warning(
            "speculators EAGLE-3 plugin: SpeculativeConfig's EAGLE-3 model list was not found "
            "in this vLLM; DeepSeek/Kimi targets stay refused by its config check"
        )
        return False
    missing = tuple(t for t in PLUGIN_TEXT_MODEL_TYPES if t not in current)
    if not missing:
        return True
    widened = current + missing
    constants = tuple(widened if value == current else value for value in code.co_consts)
    validator.__code__ = code.replace(co_consts=constants)
    return True


def register_kimi_k2_config() -> None:
    """Let vLLM 0.16 read a draft config of `model_type` `kimi_k2` (MLA drafts for Kimi targets,
    as TorchSpec and `--draft-arch mla` write them) as transformers' DeepSeek-V3 config, which it
    is; transformers 4.57 and vLLM 0.16 know no such type. Idempotent; a vLLM that knows it
    keeps its own."""
    from transformers import DeepseekV3Config
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    if "kimi_k2" not in _CONFIG_REGISTRY:
        _CONFIG_REGISTRY["kimi_k2"] = DeepseekV3Config


# vLLM's own `SpeculativeConfig.hf_config_override`, kept when it is replaced in this process.
_SHIPPED_OVERRIDE = None


def mla_aware_hf_config_override(hf_config):
    """vLLM's draft-config override, except for MLA EAGLE-3 drafts (see
    `keep_mla_drafts_as_eagle3`). A module-level function: vLLM pickles the draft's model config,
    this included, into its engine process."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and architectures[0] in MLA_DRAFT_ARCHITECTURES:
        hf_config.model_type = "deepseek_v3"
        return hf_config
    shipped = _SHIPPED_OVERRIDE
    if shipped is None:  # unpickled in a process whose plugin has not run yet: vLLM's is in place
        from vllm.config.speculative import SpeculativeConfig

        shipped = SpeculativeConfig.hf_config_override
    return shipped(hf_config)


def keep_mla_drafts_as_eagle3() -> None:
    """Keep vLLM 0.16 from reading an MLA EAGLE-3 draft as a DeepSeek MTP module.

    `SpeculativeConfig.hf_config_override` (applied to every draft config) turns any config of
    `model_type` deepseek_v3 into `DeepSeekMTPModel`. A config whose architecture is the MLA
    draft's is left as it is here, its `model_type` read as deepseek_v3 (a `kimi_k2` draft's
    too: vLLM picks its MLA attention for EAGLE drafts of DeepSeek types only). Idempotent.
    """
    global _SHIPPED_OVERRIDE
    from vllm.config.speculative import SpeculativeConfig

    current = SpeculativeConfig.hf_config_override
    if current is mla_aware_hf_config_override:
        return
    _SHIPPED_OVERRIDE = current
    SpeculativeConfig.hf_config_override = staticmethod(mla_aware_hf_config_override)
