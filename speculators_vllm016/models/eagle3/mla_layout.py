"""The MLA draft's shape and its checkpoint layout.

Shape: `mla_layer_config` builds the draft's DeepSeek layer from the target's text config
(DeepSeek-V2/V3, Kimi-K2, and the DeepSeek-V3 text config inside a Kimi-K2.5 wrapper): the same
width, heads, latent ranks, head dims, RoPE (YaRN included) and vocabulary; one layer; a dense MLP
of the target's dense `intermediate_size`.

Layout: an MLA draft's `config.json` is the flat config vLLM >= 0.18 (`Eagle3DeepseekV2ForCausalLM`)
and TorchSpec read: `architectures: ["Eagle3DeepseekV2ForCausalLM"]`, `model_type` `kimi_k2` for
Kimi targets (else `deepseek_v3`), the layer's keys at the top level, `draft_vocab_size`,
`target_hidden_size`, and an `eagle_config` holding `eagle_aux_hidden_state_layer_ids` and the
layer's conventions (`use_input_layernorm_in_first_layer`, `use_last_layernorm`). It carries no
`speculators_config` key: vLLM reads any config with one as a Llama-layer speculators draft. What
this package adds (the verifier it was trained for, the proposal length) sits under
`speculators_draft`, which the other readers ignore. The tensor names need no renaming: the
draft's own (`layers.0.self_attn.q_a_proj.weight`, `fc.weight`, `norm.weight`, `lm_head.weight`,
`d2t`, `t2d`, `embed_tokens.weight`) are the ones vLLM loads; TorchSpec's `midlayer.` prefix is read
as `layers.0.` (`MLA_KEY_MAPPING`).
"""

from __future__ import annotations

import json
from typing import Any

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "MLA_ARCHITECTURE",
    "MLA_ARCHITECTURES",
    "MLA_KEY_MAPPING",
    "is_flat_mla_config",
    "is_mla_layer_config",
    "flat_mla_config",
    "mla_layer_config",
    "speculators_dict_from_flat_mla",
]

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
# vLLM also registers the class under its V3 name.
MLA_ARCHITECTURES = (MLA_ARCHITECTURE, "Eagle3DeepseekV3ForCausalLM")
# TorchSpec names the draft's one layer `midlayer`; vLLM reads that as `layers.0`, so do we.
MLA_KEY_MAPPING = {r"^midlayer\.": "layers.0."}
# The layer-config attribute that remembers which `model_type` the flat config is written with.
EXPORTED_MODEL_TYPE = "exported_model_type"

# The layer keys of a flat config, as DeepSeek-V3 names them (what the draft's layer reads).
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# The conventions of an `eagle_config` this draft implements, and the value it needs.
_EAGLE_CONVENTIONS = {
    "use_aux_hidden_state": True,
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
}


def is_mla_layer_config(layer_config: Any) -> bool:
    """Whether a draft's `transformer_layer_config` is the MLA layer's (DeepSeek-V3 type)."""
    return getattr(layer_config, "model_type", None) == "deepseek_v3"


def _rope_scaling(text_config: Any) -> dict | None:
    """The target's RoPE scaling without the `rope_theta` that vLLM's reader copies into it."""
    scaling = getattr(text_config, "rope_scaling", None)
    if not scaling:
        return None
    return {key: value for key, value in dict(scaling).items() if key != "rope_theta"}


def mla_layer_config(
    text_config: Any, *, num_layers: int = 1, verifier_model_type: str | None = None
) -> Any:
    """The MLA draft's layer config (a transformers `DeepseekV3Config`) shaped from the target's
    text config; raises `InvalidInputError` for a target without multi-head latent attention.
    `verifier_model_type`: the outer config's type (a Kimi-K2.5 wrapper's `kimi_k25` holds a
    `deepseek_v3` text config); Kimi targets' drafts are written as `kimi_k2`, as TorchSpec's."""
    from transformers import DeepseekV3Config

    get = lambda name, default=None: getattr(text_config, name, default)  # noqa: E731
    if get("kv_lora_rank") is None or get("qk_rope_head_dim") is None:
        raise InvalidInputError(
            f"--draft-arch mla needs a DeepSeek-V2/V3 or Kimi-K2/K2.5 target (multi-head latent "
            f"attention: kv_lora_rank, qk_rope_head_dim); the target is {get('model_type')!r}; "
            "use --draft-arch llama"
        )
    if num_layers != 1:
        raise InvalidInputError(
            f"--draft-arch mla builds one decoder layer; got --num-layers {num_layers}"
        )
    heads = get("num_attention_heads")
    kimi = bool({get("model_type"), verifier_model_type} & {"kimi_k2", "kimi_k25"})
    layer = DeepseekV3Config(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        hidden_act="silu",
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        max_position_embeddings=get("max_position_embeddings", 4096),
        rope_theta=get("rope_theta", 10000.0),
        rope_scaling=_rope_scaling(text_config),
        bos_token_id=get("bos_token_id"),
        eos_token_id=get("eos_token_id"),
        pad_token_id=get("pad_token_id"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    setattr(layer, EXPORTED_MODEL_TYPE, "kimi_k2" if kimi else "deepseek_v3")
    return layer


def _plain(value: Any) -> Any:
    """JSON-ready copy of a config value (torch dtypes as their names)."""
    return json.loads(json.dumps(value, default=lambda v: str(v).removeprefix("torch.")))


def flat_mla_config(layer: dict[str, Any], speculator: dict[str, Any]) -> dict[str, Any]:
    """The flat `config.json` of an MLA draft from its layer config's full dict (`to_dict()`,
    not the diff: DeepSeek-V3's defaults are Kimi's shape and must be written out) and its
    speculators-layout dict (`Eagle3SpeculatorConfig.to_dict()`)."""
    exported = layer.get(EXPORTED_MODEL_TYPE) or "deepseek_v3"
    flat: dict[str, Any] = {"architectures": [MLA_ARCHITECTURE], "model_type": exported}
    for key in _LAYER_KEYS:
        if key in layer:
            flat[key] = layer[key]
    flat["num_hidden_layers"] = layer.get("num_hidden_layers", 1)
    flat["draft_vocab_size"] = speculator["draft_vocab_size"]
    flat["target_hidden_size"] = speculator.get("target_hidden_size") or layer.get("hidden_size")
    flat["norm_before_residual"] = bool(speculator.get("norm_before_residual", False))
    dtype = layer.get("torch_dtype") or layer.get("dtype") or speculator.get("torch_dtype")
    if dtype is not None:
        flat["torch_dtype"] = dtype
    flat["tie_word_embeddings"] = False
    aux = speculator.get("eagle_aux_hidden_state_layer_ids")
    eagle: dict[str, Any] = {}
    if aux:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(aux)
        # vLLM 0.16's model runner reads the ids at the top level of the draft's config.
        flat["eagle_aux_hidden_state_layer_ids"] = list(aux)
    eagle.update(_EAGLE_CONVENTIONS)
    flat["eagle_config"] = eagle
    ours = {
        key: speculator[key]
        for key in ("speculators_config", "speculators_version")
        if speculator.get(key) is not None
    }
    if ours:
        flat["speculators_draft"] = ours
    return _plain(flat)


def is_flat_mla_config(config_dict: dict[str, Any]) -> bool:
    """Whether a `config.json` is an MLA draft in the vLLM >= 0.18 / TorchSpec layout."""
    architectures = config_dict.get("architectures") or []
    return "speculators_model_type" not in config_dict and any(
        name in MLA_ARCHITECTURES for name in architectures
    )


def _checked_eagle_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    eagle = dict(config_dict.get("eagle_config") or {})
    for key, needed in _EAGLE_CONVENTIONS.items():
        if key in eagle and bool(eagle[key]) != needed:
            raise InvalidInputError(
                f"the MLA draft's eagle_config has {key}={eagle[key]!r}; this package's MLA "
                f"layer implements {key}={needed!r} only"
            )
    return eagle


def speculators_dict_from_flat_mla(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The speculators-layout dict (`Eagle3SpeculatorConfig`'s fields) of a flat MLA config."""
    eagle = _checked_eagle_config(config_dict)
    if int(config_dict.get("num_hidden_layers", 1)) != 1:
        raise InvalidInputError(
            f"the MLA draft has {config_dict['num_hidden_layers']} layers; this package reads "
            "one-layer MLA drafts"
        )
    layer = {key: config_dict[key] for key in _LAYER_KEYS if key in config_dict}
    layer["model_type"] = "deepseek_v3"
    layer[EXPORTED_MODEL_TYPE] = config_dict.get("model_type") or "deepseek_v3"
    dtype = config_dict.get("torch_dtype") or config_dict.get("dtype")
    if dtype is not None:
        layer["torch_dtype"] = dtype
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or config_dict.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    ours = dict(config_dict.get("speculators_draft") or {})
    result: dict[str, Any] = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": config_dict.get("draft_vocab_size") or config_dict["vocab_size"],
        "norm_before_residual": bool(config_dict.get("norm_before_residual", False)),
        "target_hidden_size": config_dict.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": list(aux) if aux else None,
        "architectures": [MLA_ARCHITECTURE],
    }
    if dtype is not None:
        result["torch_dtype"] = dtype
    result.update(ours)
    return result
