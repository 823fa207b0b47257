"""EAGLE-1/2 and HASS research checkpoints -> `EagleSpeculator` folders.

Research layout (SafeAILab/EAGLE, HArmonizedSS/HASS): a Llama-like config.json and weights
`fc.weight` (+ `fc.bias` for HASS), `layers.0.*` (no input_layernorm), optionally a copy of
the verifier's `embed_tokens.weight`, and for HASS with extra norms `embed_layernorm.weight`,
`hidden_layernorm.weight`, `lm_head_layernorm.weight`. The output uses 0.3.0's names:
`fusion_fc.*`, `transformer.*`, `embedding_layernorm.*`, `pre_lm_head_layernorm.*`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import LlamaConfig

from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
from speculators_vllm016.convert.eagle.utils import (
    detect_fusion_bias_and_layernorms,
    read_research_checkpoint,
)
from speculators_vllm016.convert.eagle.validation import check_reloaded_weights
from speculators_vllm016.models.eagle import EagleSpeculator, EagleSpeculatorConfig
from speculators_vllm016.proposals.greedy import GreedyTokenProposalConfig
from speculators_vllm016.utils.atomic_files import give_usual_modes
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

__all__ = ["EagleConverter"]

logger = logging.getLogger(__name__)

# Research prefixes -> EagleSpeculator's (0.3.0's) module names.
MODULE_RENAMES = {"fc.": "fusion_fc.", "layers.0.": "transformer."}
# Copies of verifier weights that the draft takes from the verifier at run time instead.
VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "lm_head.bias")


def greedy_speculators_config(algorithm: str, base_model: str) -> SpeculatorsConfig:
    """The speculators block of a converted draft: greedy proposals of 3 tokens, its verifier."""
    return SpeculatorsConfig(
        algorithm=algorithm,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=verifier_config_for(base_model),
    )


def verifier_config_for(base_model: str) -> VerifierConfig:
    """The verifier block of speculators_config, read from the verifier's own config.json."""
    config_dict = load_verifier_config_dict(base_model)
    return VerifierConfig(
        name_or_path=base_model,
        architectures=config_dict.get("architectures") or ["LlamaForCausalLM"],
    )


class EagleConverter:
    """Convert an EAGLE-1/2 or HASS checkpoint; variants are detected from the weight names."""

    # 0.3.0's table of the HASS extra norms outside the decoder layer (research -> ours).
    EAGLE_TO_SPECULATORS_LAYERNORM_MAPPINGS = {
        "embed_layernorm.weight": "embedding_layernorm.weight",
        "lm_head_layernorm.weight": "pre_lm_head_layernorm.weight",
    }
    # The other spellings of extra norms that research checkpoints use.
    OTHER_LAYERNORM_MAPPINGS = {
        "post_embedding_layernorm.weight": "embedding_layernorm.weight",
        "hidden_layernorm.weight": "transformer.input_layernorm.weight",
    }

    def convert(
        self,
        input_path: str | Path,
        output_path: str | Path,
        base_model: str,
        fusion_bias: bool = False,
        layernorms: bool = False,
        validate: bool = True,
        cache_dir: str | Path | None = None,
        validate_device: str = "cpu",
    ) -> None:
        checkpoint = read_research_checkpoint(input_path, cache_dir)
        research_config, weights = checkpoint.config, checkpoint.weights
        has_bias, has_norms = detect_fusion_bias_and_layernorms(weights)
        fusion_bias = fusion_bias or has_bias
        layernorms = layernorms or has_norms

        config = self.build_config(research_config, base_model, fusion_bias, layernorms)
        renamed = self.rename_weights(weights, layernorms)
        saved = self.save(config, renamed, output_path)
        logger.info("saved EAGLE speculator to %s", saved)
        if validate:
            self.validate(saved, base_model, renamed, device=validate_device)

    @staticmethod
    def layer_config_from(research_config: dict) -> LlamaConfig:
        """The single decoder layer's config from the research config.json."""
        get = research_config.get
        if "hidden_size" not in research_config:
            raise InvalidInputError("the checkpoint's config.json has no hidden_size")
        return LlamaConfig(
            vocab_size=get("vocab_size", 32000),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size", 11008),
            num_hidden_layers=1,
            num_attention_heads=get("num_attention_heads", 32),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            hidden_act=get("hidden_act", "silu"),
            max_position_embeddings=get("max_position_embeddings", 4096),
            initializer_range=get("initializer_range", 0.02),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            use_cache=get("use_cache", True),
            pad_token_id=get("pad_token_id"),
            bos_token_id=get("bos_token_id", 1),
            eos_token_id=get("eos_token_id", 2),
            tie_word_embeddings=False,
            rope_theta=get("rope_theta", 10000.0),
            rope_scaling=get("rope_scaling"),
            attention_bias=get("attention_bias", False),
            attention_dropout=get("attention_dropout", 0.0),
            mlp_bias=get("mlp_bias", False),
        )

    def build_config(
        self, research_config: dict, base_model: str, fusion_bias: bool, layernorms: bool
    ) -> EagleSpeculatorConfig:
        speculators_config = greedy_speculators_config("eagle", base_model)
        return EagleSpeculatorConfig(
            transformer_layer_config=self.layer_config_from(research_config),
            speculators_config=speculators_config,
            layernorms=layernorms,
            fusion_bias=fusion_bias,
        )

    @classmethod
    def rename_weights(
        cls, weights: dict[str, torch.Tensor], layernorms: bool
    ) -> dict[str, torch.Tensor]:
        """Research names -> EagleSpeculator names; refuses names it does not know."""
        layernorm_renames = {
            **cls.EAGLE_TO_SPECULATORS_LAYERNORM_MAPPINGS,
            **cls.OTHER_LAYERNORM_MAPPINGS,
        }
        renamed: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for name, tensor in weights.items():
            if name in VERIFIER_OWNED:
                logger.debug("dropping %s: the draft uses the verifier's", name)
                continue
            if name in layernorm_renames:
                if layernorms:
                    renamed[layernorm_renames[name]] = tensor
                else:
                    logger.warning("dropping %s: layernorms are disabled", name)
                continue
            if name == "layers.0.input_layernorm.weight" and not layernorms:
                logger.warning("dropping %s: EAGLE-1 has no input norm on its layer", name)
                continue
            prefix = next((p for p in MODULE_RENAMES if name.startswith(p)), None)
            if prefix is not None:
                renamed[MODULE_RENAMES[prefix] + name[len(prefix) :]] = tensor
                continue
            unknown.append(name)
        if unknown:
            raise InvalidInputError(
                f"not an EAGLE-1/HASS checkpoint: unexpected weights {sorted(unknown)[:8]}"
            )
        return renamed

    @staticmethod
    def save(
        config: EagleSpeculatorConfig, weights: dict[str, torch.Tensor], output_dir: str | Path
    ) -> Path:
        """Load the weights into an EagleSpeculator (shape-checked) and save_pretrained it."""
        model = EagleSpeculator(config, verifier=None, verifier_attachment_mode="detached")
        dtype = weights["fusion_fc.weight"].dtype if "fusion_fc.weight" in weights else None
        if dtype is not None and dtype.is_floating_point:
            model.to(dtype=dtype)
        expected = model.state_dict()
        # Optional parts the checkpoint lacks start as no-ops (zero bias, unit norms).
        for name, tensor in expected.items():
            if name in weights:
                continue
            if name == "fusion_fc.bias":
                weights[name] = torch.zeros_like(tensor)
            elif "layernorm" in name:
                weights[name] = torch.ones_like(tensor)
            else:
                continue
            logger.warning("%s is not in the checkpoint; initialised as a no-op", name)
        try:
            result = model.load_state_dict(weights, strict=False)
        except RuntimeError as err:
            raise InvalidInputError(f"checkpoint weights do not fit the config: {err}") from err
        if result.missing_keys or result.unexpected_keys:
            raise InvalidInputError(
                "checkpoint does not match an EAGLE layer of its config: missing "
                f"{sorted(result.missing_keys)}, unexpected {sorted(result.unexpected_keys)}"
            )
        output_dir = Path(output_dir)
        model.save_pretrained(str(output_dir))
        give_usual_modes(output_dir)
        return output_dir

    @staticmethod
    def validate(
        checkpoint_path: Path,
        base_model: str,
        weights: dict[str, torch.Tensor] | None = None,
        device: str = "cpu",
    ) -> None:
        """Reload the saved folder on `device` and check every weight came back unchanged."""
        model = EagleSpeculator.from_pretrained(
            checkpoint_path, verifier=base_model, verifier_attachment_mode="detached"
        )
        if weights is None:
            logger.info("validated %s", checkpoint_path)
            return
        check_reloaded_weights(model, weights, device, checkpoint_path)
