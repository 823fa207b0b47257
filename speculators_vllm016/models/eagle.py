"""EAGLE-1 / EAGLE-2 / HASS drafts: one decoder layer over [token embedding ; verifier hidden state].

The draft reuses the verifier's embedding table and lm_head, so only the fusion layer, the
decoder layer and (for HASS-style checkpoints) a few extra norms are its own weights.

Saved weight names follow vLLM 0.16's EAGLE-1 draft (`EagleLlamaForCausalLM`):
`fc.weight` and `layers.0.*`. Checkpoints written by speculators 0.3.0, which named them
`fusion_fc.*` and `transformer.*`, still load: `from_pretrained` renames those keys.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_serializer, field_validator, model_validator
from torch import nn
from transformers import AutoConfig, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from typing_extensions import Self

from speculators_vllm016.config import SpeculatorModelConfig
from speculators_vllm016.model import SpeculatorModel

__all__ = ["EagleSpeculator", "EagleSpeculatorConfig"]

# Keys of 0.3.0-written checkpoints -> names used here (regexes, as transformers' key_mapping).
LEGACY_KEY_MAPPING: dict[str, str] = {
    r"^fusion_fc\.": "fc.",
    r"^transformer\.": "layers.0.",
}


def _layer_config_from(value: Any) -> PretrainedConfig:
    """A transformers config object from a config or a dict (Llama when the dict has no type)."""
    if isinstance(value, PretrainedConfig):
        return value
    if isinstance(value, dict):
        values = dict(value)
        model_type = values.pop("model_type", None)
        if model_type:
            try:
                return AutoConfig.for_model(model_type, **values)
            except ValueError as err:
                raise ValueError(
                    f"transformer_layer_config has unknown model_type {model_type!r}"
                ) from err
        return LlamaConfig(**values)
    raise ValueError(
        "transformer_layer_config must be a PretrainedConfig or a dict of one, "
        f"got {type(value).__name__}"
    )


@SpeculatorModelConfig.register("eagle")
class EagleSpeculatorConfig(SpeculatorModelConfig):
    """Config of an EAGLE-1/2 (layernorms=False, fusion_bias=False) or HASS draft.

    Note: vLLM 0.16 only reads `speculators_model_type == "eagle3"` checkpoints through its
    speculators config path; "eagle" folders are for this library (and older vLLM releases).
    """

    speculators_model_type: Literal["eagle"] = "eagle"
    architectures: list[str] = Field(
        default_factory=lambda: ["EagleSpeculator"],
        description="Classes that can load these weights; the decoder layer class is appended.",
    )
    transformer_layer_architecture: str = Field(
        default="auto",
        description="Decoder layer class name, e.g. 'LlamaDecoderLayer'; 'auto' derives it "
        "from the type of transformer_layer_config.",
    )
    transformer_layer_config: PretrainedConfig = Field(
        default_factory=LlamaConfig,
        description="Config of the single decoder layer (hidden size, heads, vocab, ...).",
    )
    layernorms: bool = Field(
        default=False,
        description="HASS-style extra norms: on the embeddings, on the fused input of the "
        "decoder layer, and before the lm_head.",
    )
    fusion_bias: bool = Field(
        default=False, description="Whether the fusion layer `fc` has a bias (HASS)."
    )

    @model_validator(mode="after")
    def check_add_architectures(self) -> Self:
        """List a concrete decoder layer class among the architectures."""
        arch = self.transformer_layer_architecture
        if arch != "auto" and arch not in self.architectures:
            self.architectures.append(arch)
        return self

    @field_serializer("transformer_layer_config")
    def serialize_transformer_layer_config(self, value: PretrainedConfig) -> dict:
        return value.to_diff_dict()

    @field_validator("transformer_layer_config", mode="before")
    @classmethod
    def validate_transformer_layer_config(cls, value: Any) -> PretrainedConfig:
        return _layer_config_from(value)


def _modeling_module_for(config: PretrainedConfig) -> Any:
    """The transformers modeling module that implements `config`'s causal LM."""
    config_class = type(config)
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise TypeError(
            f"{config_class.__name__} has no causal LM in transformers; use a decoder-only "
            "config such as LlamaConfig for transformer_layer_config"
        )
    return importlib.import_module(MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__module__)


def _find_class(module: Any, suffixes: tuple[str, ...]) -> type | None:
    classes = dict(inspect.getmembers(module, inspect.isclass))
    for suffix in suffixes:
        for name, found in classes.items():
            if name.endswith(suffix) and found.__module__ == module.__name__:
                return found
    return None


@SpeculatorModel.register("eagle")
class EagleSpeculator(SpeculatorModel):
    """The EAGLE-1 draft network (also EAGLE-2 and HASS checkpoints).

    forward: logits = lm_head(norm?(decoder(fc([norm?(embed(ids)) ; verifier_hidden]))))
    where `embed` and `lm_head` come from the attached verifier.
    """

    config_class: ClassVar[type[EagleSpeculatorConfig]] = EagleSpeculatorConfig  # type: ignore[misc]
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = [  # type: ignore[misc]
        r"verifier.*",
        r"embed_tokens.*",
        r"lm_head.*",
    ]
    _keys_to_ignore_on_save: ClassVar[list[str]] = [  # type: ignore[misc]
        "embed_tokens.weight",
        "lm_head.weight",
        "lm_head.bias",
    ]

    def __init__(
        self,
        config: EagleSpeculatorConfig,
        verifier: str | os.PathLike | PreTrainedModel | None = None,
        verifier_attachment_mode: Literal["detached", "full", "train_only"] | None = None,
    ) -> None:
        if not isinstance(config, EagleSpeculatorConfig):
            raise TypeError(f"expected an EagleSpeculatorConfig, got {type(config).__name__}")
        # Verifier-owned pieces; set before super().__init__ may attach a verifier.
        object.__setattr__(self, "_verifier_embed_tokens", None)
        object.__setattr__(self, "_verifier_lm_head", None)
        super().__init__(
            config, verifier=verifier, verifier_attachment_mode=verifier_attachment_mode
        )
        layer_config = config.transformer_layer_config
        if getattr(layer_config, "_attn_implementation_internal", None) is None:
            layer_config._attn_implementation = "sdpa"
        self.hidden_size: int = layer_config.hidden_size
        decoder_class, norm_class, rotary_class = self._model_classes()
        eps = getattr(layer_config, "rms_norm_eps", 1e-6)

        self.embedding_layernorm: nn.Module | None = (
            norm_class(self.hidden_size, eps=eps) if config.layernorms else None
        )
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=config.fusion_bias)
        layer = decoder_class(layer_config, layer_idx=0)
        if not config.layernorms:
            # EAGLE-1 feeds the fused state to attention unnormalized (vLLM does the same).
            layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.pre_lm_head_layernorm: nn.Module | None = (
            norm_class(self.hidden_size, eps=eps) if config.layernorms else None
        )
        self.rotary_emb = rotary_class(config=layer_config)
        self.post_init()

    # Names used by speculators 0.3.0 for the same modules.
    @property
    def fusion_fc(self) -> nn.Linear:
        return self.fc

    @property
    def transformer(self) -> nn.Module:
        return self.layers[0]

    @property
    def embed_tokens(self) -> nn.Module | None:
        return self._verifier_embed_tokens

    @property
    def lm_head(self) -> nn.Module | None:
        return self._verifier_lm_head

    def _model_classes(self) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module]]:
        """Decoder layer, norm and rotary classes from the layer config's modeling module."""
        config = self.config
        module = _modeling_module_for(config.transformer_layer_config)
        arch = config.transformer_layer_architecture
        if arch == "auto":
            arch = type(config.transformer_layer_config).__name__.removesuffix("Config")
            arch += "DecoderLayer"
        decoder_class = getattr(module, arch, None)
        if decoder_class is None:
            raise ValueError(
                f"{module.__name__} has no decoder layer class {arch!r}; set "
                "transformer_layer_architecture (e.g. 'LlamaDecoderLayer')"
            )
        if config.transformer_layer_architecture == "auto":
            config.transformer_layer_architecture = arch
        if arch not in config.architectures:
            config.architectures.append(arch)
        norm_class = _find_class(module, ("RMSNorm", "Norm")) or nn.LayerNorm
        rotary_class = _find_class(module, ("RotaryEmbedding",))
        if rotary_class is None:
            raise ValueError(f"{module.__name__} has no rotary embedding class")
        return decoder_class, norm_class, rotary_class

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """Load; also accepts checkpoints saved by speculators 0.3.0 (fusion_fc/transformer)."""
        kwargs.setdefault("key_mapping", LEGACY_KEY_MAPPING)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def attach_verifier(
        self,
        verifier: str | os.PathLike | PreTrainedModel,
        mode: Literal["full", "train_only"] | None = None,
    ) -> PreTrainedModel:
        """Use the verifier's embedding table and lm_head (kept out of the draft's weights)."""
        resolved = super().attach_verifier(verifier, mode=mode)
        inner = getattr(resolved, "model", resolved)
        embed = getattr(inner, "embed_tokens", None)
        lm_head = getattr(resolved, "lm_head", None)
        if embed is None or lm_head is None:
            raise ValueError(
                f"verifier {type(resolved).__name__} has no embed_tokens/lm_head; EAGLE needs "
                "a causal LM such as LlamaForCausalLM"
            )
        object.__setattr__(self, "_verifier_embed_tokens", embed)
        object.__setattr__(self, "_verifier_lm_head", lm_head)
        return resolved

    def detach_verifier(self) -> None:
        super().detach_verifier()
        object.__setattr__(self, "_verifier_embed_tokens", None)
        object.__setattr__(self, "_verifier_lm_head", None)

    def _causal_mask(
        self,
        attention_mask: torch.Tensor | None,
        batch: int,
        seq: int,
        past: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Additive [batch, 1, seq, past+seq] mask: causal, plus padding from a 2D mask."""
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask
        total = past + seq
        query_pos = torch.arange(past, total, device=device)[:, None]
        key_pos = torch.arange(total, device=device)[None, :]
        allowed = (key_pos <= query_pos)[None, None].expand(batch, 1, seq, total)
        if attention_mask is not None:
            if attention_mask.shape != (batch, total):
                raise ValueError(
                    f"attention_mask must be [batch, past+seq] = {[batch, total]}, "
                    f"got {list(attention_mask.shape)}"
                )
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.FloatTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> torch.FloatTensor | CausalLMOutputWithPast:
        """Next-token logits [batch, seq, vocab] from token ids and verifier hidden states.

        `hidden_states[:, t]` is the verifier's last hidden state at position t (before its
        final norm) and `input_ids[:, t]` the token at t+1, as in EAGLE training.
        `past_key_values` is a transformers `Cache` (a DynamicCache is made when use_cache).
        """
        if self.embed_tokens is None or self.lm_head is None:
            raise ValueError("no verifier attached: call attach_verifier(verifier) first")
        if input_ids.dim() != 2 or hidden_states.dim() != 3:
            raise ValueError(
                "expected input_ids [batch, seq] and hidden_states [batch, seq, hidden], got "
                f"{list(input_ids.shape)} and {list(hidden_states.shape)}"
            )
        if hidden_states.shape[:2] != input_ids.shape or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states {list(hidden_states.shape)} does not match input_ids "
                f"{list(input_ids.shape)} and hidden size {self.hidden_size}"
            )
        if return_dict is None:
            return_dict = self.config.use_return_dict
        if use_cache and past_key_values is None:
            from transformers import DynamicCache

            past_key_values = DynamicCache()
        if past_key_values is not None and not hasattr(past_key_values, "get_seq_length"):
            raise TypeError("past_key_values must be a transformers Cache (e.g. DynamicCache)")

        batch, seq = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        embeds = self.embed_tokens(input_ids)
        if self.embedding_layernorm is not None:
            embeds = self.embedding_layernorm(embeds)
        fused = self.fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))

        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=fused.device)
            position_ids = position_ids.unsqueeze(0).expand(batch, -1)
        mask = self._causal_mask(attention_mask, batch, seq, past, fused.dtype, fused.device)
        position_embeddings = self.rotary_emb(fused, position_ids)
        out = self.layers[0](
            fused,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=bool(use_cache),
            cache_position=torch.arange(past, past + seq, device=fused.device),
            position_embeddings=position_embeddings,
        )
        out = out[0] if isinstance(out, tuple) else out
        if self.pre_lm_head_layernorm is not None:
            out = self.pre_lm_head_layernorm(out)
        logits = self.lm_head(out)
        if not return_dict:
            return logits
        return CausalLMOutputWithPast(
            logits=logits, past_key_values=past_key_values if use_cache else None
        )
