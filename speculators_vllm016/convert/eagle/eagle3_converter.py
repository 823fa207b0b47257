"""EAGLE-3 research checkpoints -> speculator folders loadable by `Eagle3DraftModel` and vLLM.

Research layout (SafeAILab/EAGLE, EAGLE-3 releases): config.json with the draft layer's Llama
fields plus `draft_vocab_size` (and sometimes `target_hidden_size`), weights `midlayer.*` (the
single decoder layer; some exports already say `layers.0.*`), `fc.weight` [H, 3*H_target],
`norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t`, `t2d`, and optionally
`embed_tokens.weight`. The output is written directly as config.json + model.safetensors with
the names `Eagle3DraftModel` saves: `layers.0.*`, `fc`, `norm`, `lm_head`, `embed_tokens`,
`d2t`, `t2d`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

# PretrainedConfig is named here because code written for 0.3.0 patches
# `eagle3_converter.PretrainedConfig.get_config_dict` to stand in for the verifier's config.
from transformers import LlamaConfig, PretrainedConfig

from speculators_vllm016.convert.eagle.eagle_converter import greedy_speculators_config
from speculators_vllm016.convert.eagle.utils import find_vocab_size, read_research_checkpoint
from speculators_vllm016.convert.eagle.validation import check_reloaded_weights
from speculators_vllm016.utils.atomic_files import give_usual_modes
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.loading import load_model_layers
from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

__all__ = ["Eagle3Converter", "PretrainedConfig"]

logger = logging.getLogger(__name__)

TOP_LEVEL = ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d")
LAYER_PREFIXES = ("midlayer.", "layers.0.")
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight")


def verifier_embeddings(base_model: str, cache_dir: str | Path | None = None) -> torch.Tensor:
    """The verifier's input embedding matrix, read (and downloaded) without the rest; inside a
    multimodal wrapper (Kimi-K2.5's `language_model.model.embed_tokens`) too."""
    names = (
        "model.embed_tokens.weight",
        "embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
    )
    try:
        found = load_model_layers(list(names), base_model, cache_dir=cache_dir)
    except (ValueError, FileNotFoundError) as err:
        wrapped = _wrapped_embeddings_name(base_model)
        if wrapped is not None:
            return load_model_layers([wrapped], base_model, cache_dir=cache_dir)[wrapped]
        raise FileNotFoundError(
            f"the checkpoint has no embed_tokens.weight and none was found in the verifier "
            f"{base_model!r} (looked for {names}): {err}"
        ) from err
    return next(found[name] for name in names if name in found)


def _wrapped_embeddings_name(base_model: str) -> str | None:
    """Where a local verifier keeps its embeddings under another layout (a wrapper's language
    model), or None."""
    if not Path(base_model).is_dir():
        return None
    from speculators_vllm016.utils.verifier_weights import locate_verifier_weights

    try:
        return locate_verifier_weights(base_model).embeddings
    except (InvalidInputError, FileNotFoundError, ValueError):
        return None


class Eagle3Converter:
    """Convert an EAGLE-3 checkpoint; embeddings and vocab maps are filled in when missing."""

    def convert(
        self,
        input_path: str | Path,
        output_path: str | Path,
        base_model: str,
        validate: bool = True,
        norm_before_residual: bool | None = None,
        eagle_aux_hidden_state_layer_ids: list[int] | None = None,
        cache_dir: str | Path | None = None,
        validate_device: str = "cpu",
        source: str | None = None,
    ) -> None:
        config, renamed = self.build(
            input_path,
            base_model,
            norm_before_residual=norm_before_residual,
            eagle_aux_hidden_state_layer_ids=eagle_aux_hidden_state_layer_ids,
            cache_dir=cache_dir,
            source=source,
        )
        saved = self.save(config, renamed, output_path)
        logger.info("saved EAGLE-3 speculator to %s", saved)
        if validate:
            self.validate(saved, renamed, device=validate_device)

    def build(
        self,
        input_path: str | Path,
        base_model: str,
        *,
        norm_before_residual: bool | None = None,
        eagle_aux_hidden_state_layer_ids: list[int] | None = None,
        cache_dir: str | Path | None = None,
        source: str | None = None,
    ):
        """The converted config and weights in memory (what `convert` saves; fine-tuning a
        research checkpoint, `speculators train --from-pretrained`, trains from them).

        `source` names the tool that wrote the checkpoint (`eagle3_sources.SOURCES`; None:
        recognized from its config.json): its mapping gives the fused layers and the residual
        placement unless they are given here; otherwise the ids stay unset (vLLM's default)
        and `norm_before_residual` is false."""
        from speculators_vllm016.convert.eagle3_sources import adapt_checkpoint

        checkpoint = read_research_checkpoint(input_path, cache_dir)
        verifier_dict = load_verifier_config_dict(base_model)
        adapted = adapt_checkpoint(
            source,
            checkpoint.config,
            checkpoint.weights,
            verifier_dict,
            aux_layer_ids=eagle_aux_hidden_state_layer_ids,
        )
        research_config, weights = adapted.config, adapted.weights
        eagle_aux_hidden_state_layer_ids = adapted.aux_layer_ids
        if norm_before_residual is None:
            norm_before_residual = bool(adapted.norm_before_residual)
        logger.info(
            "reading a %s EAGLE-3 draft: fused layers %s, norm_before_residual=%s",
            adapted.source,
            eagle_aux_hidden_state_layer_ids,
            norm_before_residual,
        )
        renamed = self.rename_weights(weights)

        if "t2d" in renamed:
            target_vocab = int(renamed["t2d"].shape[0])
        else:
            target_vocab = find_vocab_size(verifier_dict)
            if target_vocab is None:
                raise InvalidInputError(f"cannot find vocab_size in the config of {base_model!r}")
        draft_vocab = int(renamed["lm_head.weight"].shape[0])
        declared = research_config.get("draft_vocab_size")
        if declared is not None and declared != draft_vocab:
            raise InvalidInputError(
                f"config draft_vocab_size={declared} but lm_head.weight has {draft_vocab} rows"
            )
        self.fill_vocab_maps(renamed, draft_vocab, target_vocab)
        if "embed_tokens.weight" not in renamed:
            logger.info("taking embed_tokens from the verifier %s", base_model)
            embed = verifier_embeddings(base_model, cache_dir)
            renamed["embed_tokens.weight"] = embed.to(renamed["fc.weight"].dtype)

        config = self.build_config(
            research_config,
            verifier_dict,
            base_model,
            target_vocab=target_vocab,
            draft_vocab=draft_vocab,
            norm_before_residual=norm_before_residual,
            eagle_aux_hidden_state_layer_ids=eagle_aux_hidden_state_layer_ids,
        )
        self.check_shapes(config, renamed)
        return config, renamed

    @staticmethod
    def rename_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`midlayer.*` -> `layers.0.*`; refuses unknown names and missing essentials."""
        renamed: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for name, tensor in weights.items():
            if name in TOP_LEVEL:
                renamed[name] = tensor
            elif name.startswith(LAYER_PREFIXES):
                suffix = name.split(".", 2)[-1] if name.startswith("layers.0.") else name[9:]
                renamed["layers.0." + suffix] = tensor
            else:
                unknown.append(name)
        if unknown:
            raise InvalidInputError(
                f"not an EAGLE-3 checkpoint: unexpected weights {sorted(unknown)[:8]}"
            )
        missing = [name for name in REQUIRED if name not in renamed]
        if missing or not any(k.startswith("layers.0.") for k in renamed):
            raise InvalidInputError(
                f"not an EAGLE-3 checkpoint: missing {missing or ['midlayer.* / layers.0.*']}"
            )
        return renamed

    @staticmethod
    def fill_vocab_maps(
        weights: dict[str, torch.Tensor], draft_vocab: int, target_vocab: int
    ) -> None:
        """Identity d2t/t2d when the draft predicts the whole target vocabulary."""
        if ("d2t" in weights) != ("t2d" in weights):
            raise InvalidInputError("the checkpoint has only one of d2t/t2d; both are needed")
        if "d2t" not in weights:
            if draft_vocab != target_vocab:
                raise InvalidInputError(
                    f"draft vocab ({draft_vocab}) differs from the target's ({target_vocab}) "
                    "but the checkpoint has no d2t/t2d mapping"
                )
            weights["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
            weights["t2d"] = torch.ones(target_vocab, dtype=torch.bool)
        weights["d2t"] = weights["d2t"].to(torch.long)
        weights["t2d"] = weights["t2d"].to(torch.bool)
        if weights["d2t"].shape != (draft_vocab,) or weights["t2d"].shape != (target_vocab,):
            raise InvalidInputError(
                f"d2t {tuple(weights['d2t'].shape)} / t2d {tuple(weights['t2d'].shape)} do not "
                f"match draft vocab {draft_vocab} / target vocab {target_vocab}"
            )

    @staticmethod
    def layer_config_from(
        research_config: dict, verifier_dict: dict, target_vocab: int
    ) -> LlamaConfig:
        get = research_config.get
        if "hidden_size" not in research_config:
            raise InvalidInputError("the checkpoint's config.json has no hidden_size")
        dtype = get("torch_dtype") or get("dtype")
        return LlamaConfig(
            vocab_size=target_vocab,
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size", 11008),
            num_hidden_layers=get("num_hidden_layers", 1),
            num_attention_heads=get("num_attention_heads", 32),
            num_key_value_heads=get("num_key_value_heads", 8),
            head_dim=get("head_dim"),
            hidden_act=get("hidden_act", "silu"),
            # vLLM checks the draft's context length against the target's.
            max_position_embeddings=max(
                get("max_position_embeddings", 4096),
                verifier_dict.get("max_position_embeddings", 4096),
            ),
            initializer_range=get("initializer_range", 0.02),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            use_cache=True,
            attention_bias=get("attention_bias", False),
            rope_theta=get("rope_theta", 10000.0),
            rope_scaling=get("rope_scaling"),
            mlp_bias=get("mlp_bias", False),
            tie_word_embeddings=False,
            torch_dtype=dtype,
        )

    def build_config(
        self,
        research_config: dict,
        verifier_dict: dict,
        base_model: str,
        *,
        target_vocab: int,
        draft_vocab: int,
        norm_before_residual: bool,
        eagle_aux_hidden_state_layer_ids: list[int] | None,
    ):
        from speculators_vllm016.models.eagle3.config import Eagle3SpeculatorConfig

        if eagle_aux_hidden_state_layer_ids is not None and (
            not isinstance(eagle_aux_hidden_state_layer_ids, list)
            or not all(isinstance(i, int) for i in eagle_aux_hidden_state_layer_ids)
        ):
            raise InvalidInputError("eagle_aux_hidden_state_layer_ids must be a list of ints")
        speculators_config = greedy_speculators_config("eagle3", base_model)
        return Eagle3SpeculatorConfig(
            transformer_layer_config=self.layer_config_from(
                research_config, verifier_dict, target_vocab
            ),
            speculators_config=speculators_config,
            draft_vocab_size=draft_vocab,
            norm_before_residual=norm_before_residual,
            target_hidden_size=research_config.get("target_hidden_size"),
            eagle_aux_hidden_state_layer_ids=eagle_aux_hidden_state_layer_ids,
        )

    def _create_transformer_config_from_eagle(
        self, eagle_config: dict, base_model: str
    ) -> LlamaConfig:
        """0.3.0's name: the draft layer's LlamaConfig from a research config.json alone.

        The target vocabulary is the config's `target_vocab_size` (0.3.0's default 128000);
        `convert` takes it from the weights instead. The verifier's config is read for its
        context length; a verifier that cannot be read raises (ValueError).
        """
        verifier_dict = load_verifier_config_dict(base_model)
        return self.layer_config_from(
            eagle_config, verifier_dict, eagle_config.get("target_vocab_size", 128000)
        )

    def _build_eagle3_speculator_config(
        self,
        eagle_config: dict,
        base_model: str,
        norm_before_residual: bool = False,
        eagle_aux_hidden_state_layer_ids: list[int] | None = None,
    ):
        """0.3.0's name: the speculator config from a research config.json alone.

        The draft vocabulary is the config's `draft_vocab_size` (0.3.0's default 32000);
        `convert` takes it from lm_head.weight and checks the two agree.
        """
        return self.build_config(
            eagle_config,
            load_verifier_config_dict(base_model),
            base_model,
            target_vocab=eagle_config.get("target_vocab_size", 128000),
            draft_vocab=eagle_config.get("draft_vocab_size", 32000),
            norm_before_residual=norm_before_residual,
            eagle_aux_hidden_state_layer_ids=eagle_aux_hidden_state_layer_ids,
        )

    @staticmethod
    def check_shapes(config, weights: dict[str, torch.Tensor]) -> None:
        """Every tensor against the model the config describes (built on the meta device)."""
        from speculators_vllm016.models.eagle3 import Eagle3DraftModel

        with torch.device("meta"):
            model = Eagle3DraftModel(config)
        expected_all = {
            name: tuple(tensor.shape)
            for name, tensor in model.state_dict().items()
            if name not in Eagle3DraftModel._keys_to_ignore_on_save
        }
        missing = sorted(set(expected_all) - set(weights))
        unexpected = sorted(set(weights) - set(expected_all))
        mismatched = {
            name: (tuple(weights[name].shape), shape)
            for name, shape in expected_all.items()
            if name in weights and tuple(weights[name].shape) != shape
        }
        if missing or unexpected or mismatched:
            raise InvalidInputError(
                "weights do not match the config: "
                + "; ".join(
                    part
                    for part in (
                        f"missing {missing[:8]}" if missing else "",
                        f"unexpected {unexpected[:8]}" if unexpected else "",
                        f"shapes (got, expected) {dict(list(mismatched.items())[:8])}"
                        if mismatched
                        else "",
                    )
                    if part
                )
            )
        layer = config.transformer_layer_config
        hidden = layer.hidden_size
        target_hidden = config.target_hidden_size or hidden
        expected = {
            "fc.weight": (hidden, 3 * target_hidden),
            "norm.weight": (hidden,),
            "lm_head.weight": (config.draft_vocab_size, hidden),
            "embed_tokens.weight": (layer.vocab_size, hidden),
        }
        head_dim = getattr(layer, "head_dim", None) or hidden // layer.num_attention_heads
        expected["layers.0.self_attn.q_proj.weight"] = (
            layer.num_attention_heads * head_dim,
            2 * hidden,
        )
        wrong = {
            name: (tuple(weights[name].shape), shape)
            for name, shape in expected.items()
            if name in weights and tuple(weights[name].shape) != shape
        }
        if wrong:
            raise InvalidInputError(f"weights do not match the config (got, expected): {wrong}")

    @staticmethod
    def save(config, weights: dict[str, torch.Tensor], output_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(output_dir))
        tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
        save_file(tensors, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
        give_usual_modes(output_dir)
        return output_dir

    @staticmethod
    def validate(
        checkpoint_path: Path, weights: dict[str, torch.Tensor], device: str = "cpu"
    ) -> None:
        """Reload with the library's EAGLE-3 model on `device` and compare every tensor."""
        from speculators_vllm016.model import SpeculatorModel

        model = SpeculatorModel.from_pretrained(checkpoint_path)
        check_reloaded_weights(
            model, weights, device, checkpoint_path, what="converted EAGLE-3 checkpoint"
        )
