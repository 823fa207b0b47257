"""The verifier as a transformers causal LM, also when it sits inside a multimodal wrapper.

`speculators eval --engine hf` runs the verifier with transformers. A plain causal LM loads as
transformers loads it. A wrapper such as Kimi-K2.5 (`KimiK25ForConditionalGeneration`: a
DeepSeek-V3 language model beside a vision tower, config and modeling code only in its folder)
loads as the causal LM of its `text_config`, built by transformers from the config vLLM 0.16
reads (or, where eval's set-up read config.json already, from that reading, as vLLM's Kimi-K2.5
config builds it: not read again), with the language model's tensors taken from the wrapper's
checkpoint: no code from the folder runs and no vision tensor is read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.language_model_layout import find_language_model_layout
from speculators_vllm016.utils.loading import checkpoint_tensor_names, read_checkpoint_tensors
from speculators_vllm016.utils.quantized_weights import QUANTIZATION_TENSOR_SUFFIXES
from speculators_vllm016.utils.text_config import text_config_of
from speculators_vllm016.utils.verifier_config import load_verifier_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["load_verifier_lm"]

logger = logging.getLogger(__name__)


def load_verifier_lm(
    path: str,
    dtype: torch.dtype | str = "auto",
    trust_remote_code: bool = False,
    config_dict: dict | None = None,
) -> PreTrainedModel:
    """The verifier at `path` as a transformers causal LM (on the CPU, in `dtype`).

    Wrappers (a config with a nested text config) give their language model; errors are one-line
    `ValueError`s (an unknown layout, a quantized language model, missing tensors).
    `config_dict`: its config.json where the caller read it (eval's set-up); a plain causal LM
    transformers has a class for, or a wrapper whose language model is one, is then built from
    it, without reading config.json again.
    """
    plain = _plain_config(config_dict) if config_dict is not None else None
    if plain is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            path, config=plain, dtype=dtype, trust_remote_code=trust_remote_code
        )
    wrapped = _wrapped_text_config(config_dict) if config_dict is not None else None
    if wrapped is not None:
        return _load_wrapped_language_model(path, _architecture(config_dict), wrapped, dtype)
    config = load_verifier_config(path, trust_remote_code=trust_remote_code)
    text_config = text_config_of(config)
    if text_config is config:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    return _load_wrapped_language_model(path, _architecture(config), text_config, dtype)


def _plain_config(config_dict: dict) -> PretrainedConfig | None:
    """transformers' config of a plain causal LM's config.json, as `AutoConfig` builds it from
    the file; None for a wrapper (nested text config) or a model type transformers has no
    class for (those are read as before: `load_verifier_config`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if text_config_of(config_dict) is not config_dict or model_type not in CONFIG_MAPPING:
        return None
    if "AutoConfig" in (config_dict.get("auto_map") or {}):
        return None  # its folder's own config class: built as before, where it is allowed
    return CONFIG_MAPPING[model_type].from_dict(dict(config_dict))


def _wrapped_text_config(config_dict: dict) -> PretrainedConfig | None:
    """transformers' config of a wrapper's language model, from the wrapper's config.json: the
    nested text config built by the class transformers has for its model type, as vLLM 0.16's
    Kimi-K2.5 config builds it (`DeepseekV3Config(**text_config)`; vLLM's later RoPE patching
    adds `rope_parameters`, which transformers 4's models do not read). None for a plain config
    or a text model type transformers has no class for (read as before: `load_verifier_config`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = text_config_of(config_dict)
    if text is config_dict or text.get("model_type") not in CONFIG_MAPPING:
        return None
    return CONFIG_MAPPING[text["model_type"]].from_dict(dict(text))


def _architecture(config: Any) -> str:
    """The model's architecture names for messages (a config object or its config.json dict)."""
    if isinstance(config, dict):
        return ", ".join(config.get("architectures") or [str(config.get("model_type"))])
    return ", ".join(getattr(config, "architectures", None) or [type(config).__name__])


def _language_model_state(path: str, architecture: str) -> dict[str, Any]:
    """The wrapper's language-model tensors under the causal LM's names (`model.*`, `lm_head.*`)."""
    names = checkpoint_tensor_names(path)
    layout = find_language_model_layout(names)
    if layout is None:
        raise InvalidInputError(
            f"{path} ({architecture}) holds no language model tensors under a known prefix "
            "(language_model.model., language_model., model.language_model.)"
        )
    wanted = {name: causal for name in names if (causal := layout.causal_name(name)) is not None}
    quantized = sorted(
        name for name in wanted if name.rsplit(".", 1)[-1] in QUANTIZATION_TENSOR_SUFFIXES
    )
    if quantized:
        raise InvalidInputError(
            f"{path} stores its language model quantized (e.g. {quantized[0]}); the hf engine reads "
            "unquantized weights only: evaluate on an unquantized copy, or with --engine vllm on a GPU"
        )
    tensors = read_checkpoint_tensors(path, wanted)
    return {wanted[name]: tensor for name, tensor in tensors.items()}


def _load_wrapped_language_model(
    path: str, architecture: str, text_config: PretrainedConfig, dtype: torch.dtype | str
) -> PreTrainedModel:
    """The wrapper's language model, built from `text_config` with the checkpoint's language
    model tensors (`architecture`: the wrapper's, for messages)."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]
    except KeyError:
        raise InvalidInputError(
            f"transformers has no causal LM for the language model of {path} ({architecture}, "
            f"text model type {getattr(text_config, 'model_type', None)!r}); use --engine vllm"
        ) from None
    state = _language_model_state(path, architecture)
    model, info = model_class.from_pretrained(
        None, config=text_config, state_dict=state, dtype=dtype, output_loading_info=True
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise InvalidInputError(
            f"the language model of {path} lacks {len(missing)} tensors (e.g. {missing[0]}); "
            "is the checkpoint complete?"
        )
    if info.get("unexpected_keys"):
        logger.info("%s: %d language-model tensors not used", path, len(info["unexpected_keys"]))
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the text config's token ids stay
        pass
    return model.eval()
