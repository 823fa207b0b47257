"""EAGLE-1 / EAGLE-2 / HASS drafts: one decoder layer over [token embedding ; verifier hidden state].

The draft reuses the verifier's embedding table, rotary embedding and lm_head, so only the
fusion layer, the decoder layer and (for HASS-style checkpoints) a few extra norms are its own
weights.

Saved weight names are speculators 0.3.0's: `fusion_fc.*`, `transformer.*`,
`embedding_layernorm.*`, `pre_lm_head_layernorm.*`, so folders move both ways between 0.3.0 and
this library. Folders written by earlier builds of this library (`fc.*`, `layers.0.*`, the names
of vLLM's own EAGLE-1 draft) still load: `from_pretrained` renames those keys.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_serializer, field_validator, model_validator
from torch import nn
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from typing_extensions import Self

from speculators_vllm016.config import SpeculatorModelConfig
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.layer_config import transformer_layer_config_from
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["EagleSpeculator", "EagleSpeculatorConfig"]

# Keys of folders saved by earlier builds of this library -> 0.3.0's names (transformers'
# key_mapping regexes).
EARLIER_KEY_MAPPING: dict[str, str] = {
    r"^fc\.": "fusion_fc.",
    r"^layers\.0\.": "transformer.",
}


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
        default=False, description="Whether the fusion layer `fusion_fc` has a bias (HASS)."
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
        return transformer_layer_config_from(value)


def _modeling_module_for(config: PretrainedConfig) -> Any:
    """The transformers modeling module that implements `config`'s causal LM."""
    config_class = type(config)
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise TypeError(
            f"Config class {config_class} is not a valid causal language model config class. "
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


def causal_attention_mask(
    attention_mask: torch.Tensor | None,
    batch: int,
    seq: int,
    past: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive [batch, 1, seq, past+seq] mask: causal, plus padding from a 2D mask.

    A 4D mask is taken as already additive and returned unchanged.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    total = past + seq
    query_pos = torch.arange(past, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None].expand(batch, 1, seq, total)
    if attention_mask is not None:
        if attention_mask.shape != (batch, total):
            raise InvalidInputError(
                f"attention_mask must be [batch, past+seq] = {[batch, total]}, "
                f"got {list(attention_mask.shape)}"
            )
        allowed = allowed & attention_mask.to(device).bool()[:, None, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


@SpeculatorModel.register("eagle")
class EagleSpeculator(SpeculatorModel):
    """The EAGLE-1 draft network (also EAGLE-2 and HASS checkpoints).

    forward: logits = lm_head(norm?(transformer(fusion_fc([norm?(embed(ids)) ; verifier_hidden]))))
    where `embed_tokens`, `rotary_emb` and `lm_head` are the attached verifier's modules (None
    while detached). They are child modules, as in 0.3.0, but never saved with the draft.
    """

    config_class: ClassVar[type[EagleSpeculatorConfig]] = EagleSpeculatorConfig  # type: ignore[misc]
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = [  # type: ignore[misc]
        r"verifier\..*",
        r"embed_tokens\..*",
        r"lm_head\..*",
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
        super().__init__(
            config, verifier=verifier, verifier_attachment_mode=verifier_attachment_mode
        )
        self.embed_tokens: nn.Module | None = None
        self.rotary_emb: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        # The layer is built from a copy: the caller's config is not the place for the
        # attention implementation this draft picks.
        layer_config = copy.deepcopy(config.transformer_layer_config)
        if getattr(layer_config, "_attn_implementation_internal", None) is None:
            layer_config._attn_implementation = "sdpa"
        self.vocab_size: int = layer_config.vocab_size
        self.hidden_size: int = layer_config.hidden_size
        self.padding_idx: int | None = getattr(layer_config, "pad_token_id", None)
        decoder_class, norm_class = self._model_classes()
        eps = getattr(layer_config, "rms_norm_eps", 1e-6)

        self.embedding_layernorm: nn.Module | None = (
            norm_class(self.hidden_size, eps=eps) if config.layernorms else None
        )
        self.fusion_fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=config.fusion_bias)
        self.transformer = decoder_class(layer_config, layer_idx=0)
        if not config.layernorms:
            # EAGLE-1 feeds the fused state to attention unnormalized (vLLM does the same).
            self.transformer.input_layernorm = nn.Identity()
        self.pre_lm_head_layernorm: nn.Module | None = (
            norm_class(self.hidden_size, eps=eps) if config.layernorms else None
        )
        self.post_init()

    def _model_classes(self) -> tuple[type[nn.Module], type[nn.Module]]:
        """Decoder layer and norm classes from the layer config's modeling module."""
        config = self.config
        module = _modeling_module_for(config.transformer_layer_config)
        arch = config.transformer_layer_architecture
        if arch == "auto":
            arch = type(config.transformer_layer_config).__name__.removesuffix("Config")
            arch += "DecoderLayer"
        decoder_class = getattr(module, arch, None)
        if decoder_class is None:
            raise InvalidInputError(
                f"{module.__name__} has no decoder layer class {arch!r}; set "
                "transformer_layer_architecture (e.g. 'LlamaDecoderLayer')"
            )
        if config.transformer_layer_architecture == "auto":
            config.transformer_layer_architecture = arch
        if arch not in config.architectures:
            config.architectures.append(arch)
        norm_class = _find_class(module, ("RMSNorm", "Norm")) or nn.LayerNorm
        return decoder_class, norm_class

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """Load; also takes folders of earlier builds of this library (`fc.*`, `layers.0.*`)."""
        kwargs.setdefault("key_mapping", EARLIER_KEY_MAPPING)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def attach_verifier(
        self,
        verifier: str | os.PathLike | PreTrainedModel,
        mode: Literal["full", "train_only"] | None = None,
    ) -> PreTrainedModel | None:
        """Use the verifier's embedding table, rotary embedding and lm_head.

        Both modes keep them (so `forward` works); "full" also keeps the verifier model.
        """
        if self._holds_verifier():
            return super().attach_verifier(verifier, mode=mode)  # raises RuntimeError
        resolved = self.resolve_verifier(verifier)
        inner = getattr(resolved, "model", resolved)
        parts = {
            "embed_tokens": getattr(inner, "embed_tokens", None),
            "rotary_emb": getattr(inner, "rotary_emb", None),
            "lm_head": getattr(resolved, "lm_head", None),
        }
        lacking = [name for name, module in parts.items() if module is None]
        if lacking:
            raise InvalidInputError(
                f"verifier {type(resolved).__name__} has no {lacking}; EAGLE needs a causal LM "
                "such as LlamaForCausalLM"
            )
        attached = super().attach_verifier(resolved, mode=mode)
        self.embed_tokens = parts["embed_tokens"]
        self.rotary_emb = parts["rotary_emb"]
        self.lm_head = parts["lm_head"]
        return attached

    def _holds_verifier(self) -> bool:
        return super()._holds_verifier() or self.embed_tokens is not None

    def detach_verifier(self) -> None:
        super().detach_verifier()
        self.embed_tokens = None
        self.rotary_emb = None
        self.lm_head = None

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
        if self.embed_tokens is None or self.rotary_emb is None or self.lm_head is None:
            raise InvalidInputError(
                "Verifier model layers not initialized. "
                "no verifier attached: call attach_verifier(verifier) first"
            )
        if input_ids.dim() != 2 or hidden_states.dim() != 3:
            raise InvalidInputError(
                "expected input_ids [batch, seq] and hidden_states [batch, seq, hidden], got "
                f"{list(input_ids.shape)} and {list(hidden_states.shape)}"
            )
        if (
            hidden_states.shape[:2] != input_ids.shape
            or hidden_states.shape[-1] != self.hidden_size
        ):
            raise InvalidInputError(
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
        fused = self.fusion_fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))

        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=fused.device)
            position_ids = position_ids.unsqueeze(0).expand(batch, -1)
        mask = causal_attention_mask(attention_mask, batch, seq, past, fused.dtype, fused.device)
        position_embeddings = self.rotary_emb(fused, position_ids)
        out = self.transformer(
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
