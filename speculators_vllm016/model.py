"""Base class of speculator (draft) models: Hugging Face loading/saving plus verifier handling.

`SpeculatorModel.from_pretrained(path)` reads `config.json` into its registered config class,
finds the registered model class whose `config_class` that is, and loads it, so user code need
not know the algorithm. A
verifier (the target model) can be attached for training ("train_only": only the parts the draft
needs) or for generation ("full"); it is never part of the saved weights.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Optional

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel

from speculators_vllm016.config import SpeculatorModelConfig, default_speculative_tokens
from speculators_vllm016.models.verifier_states import ResidualStreamStates
from speculators_vllm016.utils import ClassRegistryMixin
from speculators_vllm016.utils.errors import InvalidInputError, UnsupportedError

__all__ = ["SpeculatorModel", "reload_and_populate_models"]

AttachmentMode = Literal["detached", "full", "train_only"]

# Set while from_pretrained builds a model: the verifier is attached after the weights load.
_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "speculators_loading", default=False
)


def _check_verifier_argument(verifier: Any) -> None:
    if isinstance(verifier, (str, os.PathLike)) and not str(verifier):
        raise InvalidInputError("verifier must name a model: got an empty path")
    if verifier is None:
        raise InvalidInputError(
            "Verifier must be provided as a path, identifier, or PreTrainedModel. "
            "verifier must be a PreTrainedModel, a hub id or a local path, got None"
        )
    if not isinstance(verifier, (str, os.PathLike, PreTrainedModel)):
        raise TypeError(
            "Expected verifier to be a PreTrainedModel, a string path, or an os.PathLike "
            f"object, got {type(verifier)}. verifier must be a PreTrainedModel, a hub id or a "
            f"local path, got {type(verifier).__name__}"
        )


def _check_attachment_mode(mode: Any) -> None:
    if mode not in (None, "full", "train_only"):
        raise InvalidInputError(
            f"Invalid verifier_attachment_mode: {mode}. "
            "Must be one of 'full', 'train_only', or None."
        )


class SpeculatorModel(ClassRegistryMixin, PreTrainedModel, GenerationMixin):
    """Common behaviour of all draft models; subclasses register under their model type."""

    auto_package: ClassVar[str] = "speculators.models"
    registry_auto_discovery: ClassVar[bool] = True
    config_class: ClassVar[type[SpeculatorModelConfig]] = SpeculatorModelConfig  # type: ignore[misc]
    base_model_prefix: ClassVar[str] = "model"  # type: ignore[misc]
    main_input_name: ClassVar[str] = "input_ids"  # type: ignore[misc]
    _keys_to_ignore_on_load_missing: ClassVar[list[str] | None] = [r"verifier\..*"]  # type: ignore[misc]

    @classmethod
    def registered_model_class_from_config(
        cls, config: SpeculatorModelConfig
    ) -> type[SpeculatorModel]:
        """The registered model class whose `config_class` is exactly `type(config)`.

        Matching on the config class (not on the registry name) lets a model registered under
        any name load, as in 0.3.0.
        """
        if not isinstance(config, SpeculatorModelConfig):
            raise TypeError(
                "Expected config to be an instance of SpeculatorModelConfig, "
                f"got {type(config)}. Pass the config of a model type, not a "
                f"{type(config).__name__}"
            )
        if type(config) is SpeculatorModelConfig:
            raise TypeError(
                "Received a SpeculatorModelConfig instance but expected a subclass. "
                "got the base SpeculatorModelConfig; use the config class of a model type "
                "(e.g. Eagle3SpeculatorConfig), or SpeculatorModelConfig.from_dict/from_pretrained"
            )
        if cls.registry_auto_discovery:
            cls.auto_populate_registry()
        if not cls.registry:
            raise InvalidInputError(
                "No registered model classes found. "
                "no speculator model class is registered; register one with "
                "@SpeculatorModel.register(name)"
            )
        for model_class in cls.registry.values():
            if type(config) is model_class.config_class:
                return model_class
        raise InvalidInputError(
            f"No registered model class found for config type {type(config)}. "
            f"no registered speculator model has config_class {type(config).__name__}; "
            f"registered: {sorted(cls.registry)}"
        )

    @classmethod
    def from_pretrained(
        cls: type[SpeculatorModel],
        pretrained_model_name_or_path: str | os.PathLike | None,
        *model_args: Any,
        verifier: str | os.PathLike | PreTrainedModel | None = None,
        verifier_attachment_mode: AttachmentMode | None = None,
        config: PretrainedConfig | str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        ignore_mismatched_sizes: bool = False,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        revision: str = "main",
        use_safetensors: bool | None = None,
        weights_only: bool = True,
        **kwargs: Any,
    ) -> SpeculatorModel:
        """Load a saved draft; called on `SpeculatorModel`, the class comes from the config.

        Refuses (ValueError) a checkpoint that lacks weights the model needs instead of leaving
        them randomly initialised. The verifier (the argument, else the config's
        `speculators_config.verifier.name_or_path`) is attached after the weights are loaded,
        unless `verifier_attachment_mode="detached"`.
        """
        if config is None:
            if not pretrained_model_name_or_path:
                raise InvalidInputError(
                    "Either `config` or `pretrained_model_name_or_path` must be provided to "
                    "load a SpeculatorModel. from_pretrained needs a checkpoint path (or a "
                    "config and a state_dict)"
                )
            config = cls.config_class.from_pretrained(
                pretrained_model_name_or_path,
                cache_dir=cache_dir,
                force_download=force_download,
                local_files_only=local_files_only,
                token=token,
                revision=revision,
            )
        if not isinstance(config, SpeculatorModelConfig):
            raise TypeError(
                "Expected config to be an instance of SpeculatorModelConfig, "
                f"got {type(config)}. "
                f"config must be a SpeculatorModelConfig, got {type(config).__name__}; to read "
                "one from a folder use SpeculatorModelConfig.from_pretrained(path)"
            )
        if not pretrained_model_name_or_path and kwargs.get("state_dict") is None:
            raise InvalidInputError(
                "Either `pretrained_model_name_or_path` or `state_dict` must be provided to "
                "load a SpeculatorModel. from_pretrained needs a checkpoint path or a state_dict"
            )
        loader_arguments = {
            "cache_dir": cache_dir,
            "ignore_mismatched_sizes": ignore_mismatched_sizes,
            "force_download": force_download,
            "local_files_only": local_files_only,
            "token": token,
            "revision": revision,
            "use_safetensors": use_safetensors,
            "weights_only": weights_only,
            **kwargs,
        }
        if cls is SpeculatorModel:
            # The registered class loads itself, so its own from_pretrained (key renames) runs.
            return cls.registered_model_class_from_config(config).from_pretrained(
                pretrained_model_name_or_path,
                *model_args,
                verifier=verifier,
                verifier_attachment_mode=verifier_attachment_mode,
                config=config,
                **loader_arguments,
            )
        model_class = cls
        key_mapping = model_class.checkpoint_key_mapping(config)
        if key_mapping and loader_arguments.get("key_mapping") is None:
            loader_arguments["key_mapping"] = key_mapping
        return_loading_info = loader_arguments.pop("output_loading_info", False)
        loading = _LOADING.set(True)
        try:
            model, loading_info = PreTrainedModel.from_pretrained.__func__(  # type: ignore[attr-defined]
                model_class,
                pretrained_model_name_or_path,
                *model_args,
                config=config,
                output_loading_info=True,
                **loader_arguments,
            )
        finally:
            _LOADING.reset(loading)
        missing = model.complete_missing_weights(list(loading_info.get("missing_keys") or []))
        if missing:
            source = pretrained_model_name_or_path or "the state_dict"
            raise InvalidInputError(
                f"{source} lacks {len(missing)} weight(s) that {model_class.__name__} needs "
                f"(e.g. {sorted(missing)[:5]}); loading would leave them randomly initialised. "
                "Pass a checkpoint of this model type, saved by this library or speculators 0.3.0"
            )
        pending = model.__dict__.pop("_pending_verifier", None)
        if verifier_attachment_mode != "detached":
            target = verifier if verifier is not None else (pending[0] if pending else None)
            mode = verifier_attachment_mode or (pending[1] if pending else None)
            if target is not None:
                if model.verifier_attachment_mode != "detached":
                    model.detach_verifier()
                model.attach_verifier(target, mode=mode)
        if return_loading_info:
            return model, loading_info
        return model

    @classmethod
    def checkpoint_key_mapping(cls, config: SpeculatorModelConfig) -> dict[str, str] | None:
        """Renames (regex -> replacement) of the tensor names of `config`'s checkpoints that
        other tools wrote, applied on loading only; None: names are read as saved."""
        return None

    def complete_missing_weights(self, missing: list[str]) -> list[str]:
        """Fill the tensors a checkpoint may leave out because their value follows from the
        config; returns the names still missing (an error). Here: none filled."""
        return missing

    def __init__(
        self,
        config: SpeculatorModelConfig,
        verifier: str | os.PathLike | PreTrainedModel | None = None,
        verifier_attachment_mode: AttachmentMode | None = None,
        **kwargs: Any,
    ) -> None:
        if config is None:
            raise InvalidInputError(
                "Config must be provided to initialize a SpeculatorModel. "
                "a SpeculatorModel needs a config: pass an instance of a SpeculatorModelConfig "
                "subclass (e.g. EagleSpeculatorConfig)"
            )
        if not isinstance(config, SpeculatorModelConfig):
            raise TypeError(
                "Expected config to be an instance of SpeculatorModelConfig, "
                f"got {type(config)}. A SpeculatorModel is built from the config of its model "
                f"type, not a {type(config).__name__}"
            )
        super().__init__(config, **kwargs)
        self.verifier: PreTrainedModel | None = None
        self.verifier_attachment_mode: AttachmentMode = "detached"
        # As in 0.3.0 the verifier named in the config is attached unless told "detached". It
        # is attached once the subclass has built its layers (post_init), or, inside
        # from_pretrained, once the weights are loaded.
        if verifier is None and config.speculators_config is not None:
            verifier = config.speculators_config.verifier.name_or_path
        if verifier is not None and verifier_attachment_mode != "detached":
            # A wrong verifier or mode fails here, as in 0.3.0, not later in post_init.
            _check_attachment_mode(verifier_attachment_mode)
            _check_verifier_argument(verifier)
            self._pending_verifier = (verifier, verifier_attachment_mode)
        else:
            self._pending_verifier = None

    def post_init(self) -> None:
        super().post_init()
        if _LOADING.get():
            return  # from_pretrained attaches after loading the weights
        pending = self.__dict__.pop("_pending_verifier", None)
        if pending is not None:
            self.attach_verifier(pending[0], mode=pending[1])

    def resolve_verifier(self, verifier: str | os.PathLike | PreTrainedModel) -> PreTrainedModel:
        """A loaded verifier model from a model object, a hub id or a local path."""
        _check_verifier_argument(verifier)
        if isinstance(verifier, PreTrainedModel):
            return verifier
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(verifier)

    def attach_verifier(
        self,
        verifier: str | os.PathLike | PreTrainedModel,
        mode: Literal["full", "train_only"] | None = None,
    ) -> PreTrainedModel | None:
        """Attach the verifier: "full" keeps the model (for `generate`), "train_only" does not.

        In "train_only" mode `self.verifier` stays None; subclasses keep the parts they train
        with (EAGLE: the verifier's embeddings, rotary embedding and lm_head). Returns the
        verifier model in "full" mode.
        """
        attached = self.verifier_attachment_mode
        if attached == "full" or (attached != "detached" and self._holds_verifier()):
            raise RuntimeError(
                "Cannot attach a verifier when the speculator is not in detached mode. "
                f"a verifier is already attached ({self.verifier_attachment_mode!r}); call "
                "detach_verifier() before attaching another"
            )
        _check_attachment_mode(mode)
        _check_verifier_argument(verifier)
        mode = mode or "full"
        resolved = self.resolve_verifier(verifier) if mode == "full" else None
        self.verifier = resolved  # a child module, as in 0.3.0; never part of state_dict()
        self.verifier_attachment_mode = mode
        return resolved

    def _holds_verifier(self) -> bool:
        """Whether the verifier or parts of it are attached (subclasses add the parts they keep).

        A draft built "train_only" that keeps nothing of the verifier (EAGLE-3 copies what it
        needs) may take a verifier for `generate` without detaching first.
        """
        return self.verifier is not None

    def detach_verifier(self) -> None:
        if self.verifier_attachment_mode == "detached":
            raise RuntimeError(
                "Verifier is already detached, cannot be called again until a new verifier is "
                "attached. no verifier is attached (detach_verifier was already called)"
            )
        self.verifier = None
        self.verifier_attachment_mode = "detached"

    def state_dict(
        self,
        *,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """The draft's own weights: neither an attached verifier nor `_keys_to_ignore_on_save`."""
        verifier = self._modules.get("verifier")
        if verifier is not None:
            self._modules["verifier"] = None
        try:
            state = nn.Module.state_dict(
                self, destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        finally:
            if verifier is not None:
                self._modules["verifier"] = verifier
        ignored = getattr(self, "_keys_to_ignore_on_save", None) or []
        for key in [k for k in state if k.removeprefix(prefix) in ignored]:
            state.pop(key)
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "The forward method is only supported on concrete speculator model subclasses. "
            f"{type(self).__name__} does not implement forward"
        )

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: Any | None = None,
        logits_processor: Any | None = None,
        stopping_criteria: Any | None = None,
        prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
        synced_gpus: bool | None = None,
        assistant_model: Optional[PreTrainedModel] = None,  # noqa: UP045 - 0.3.0 signature
        streamer: Any | None = None,
        negative_prompt_ids: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        use_model_defaults: bool | None = None,
        custom_generate: str | Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Greedy speculative decoding: the draft proposes, the attached verifier decides.

        A reference implementation for checking a draft (its output is the verifier's own greedy
        output; `self.last_acceptance` reports how many proposals were accepted), not a fast one:
        every round runs the verifier over the whole sequence without a KV cache. Serve drafts
        with vLLM for speed. Supports batch size 1, greedy decoding, `max_new_tokens`,
        `eos_token_id` and `num_speculative_tokens` (default: the config's proposal method).
        """
        unsupported = {
            "logits_processor": logits_processor,
            "stopping_criteria": stopping_criteria,
            "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn,
            "assistant_model": assistant_model,
            "streamer": streamer,
            "negative_prompt_ids": negative_prompt_ids,
            "custom_generate": custom_generate,
        }
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise UnsupportedError(f"speculative generate does not support {given}")
        if self.verifier is None or self.verifier_attachment_mode != "full":
            raise RuntimeError("attach a verifier in 'full' mode to generate (attach_verifier)")
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidInputError("generate takes input_ids of shape [1, seq_len] (batch size 1)")
        settings = generation_config.to_dict() if generation_config is not None else {}
        settings.update(kwargs)
        if settings.get("do_sample"):
            raise UnsupportedError("only greedy speculative decoding is implemented")
        max_new_tokens = int(settings.get("max_new_tokens") or 20)
        eos = settings.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        proposals = default_speculative_tokens(self.config)
        k = int(settings.get("num_speculative_tokens") or proposals)

        verifier = self.verifier
        tokens = input_ids.to(next(verifier.parameters()).device)
        with ResidualStreamStates(verifier) as streams:  # aux id N: the last layer's output
            generated, proposed, accepted = self._speculate(
                verifier, streams, tokens, k, max_new_tokens, eos_ids
            )
        self.last_acceptance = {"proposed": proposed, "accepted": accepted}
        return generated

    def _speculate(
        self,
        verifier: nn.Module,
        streams: ResidualStreamStates,
        tokens: torch.Tensor,
        k: int,
        max_new_tokens: int,
        eos_ids: set[int],
    ) -> tuple[torch.Tensor, int, int]:
        """`generate`'s loop: the output ids, and the tokens proposed and accepted."""
        prompt_length = tokens.shape[1]
        proposed = accepted = 0
        output = verifier(tokens, output_hidden_states=True, use_cache=False)
        states = streams.of(output)
        tokens = torch.cat([tokens, output.logits[:, -1:].argmax(-1)], dim=1)
        while (
            tokens.shape[1] - prompt_length < max_new_tokens and int(tokens[0, -1]) not in eos_ids
        ):
            # The draft sees the verifier's states for every position but the newest token.
            draft = self.propose_tokens(states, tokens, k)
            candidate = torch.cat([tokens, draft.view(1, -1).to(tokens.device)], dim=1)
            output = verifier(candidate, output_hidden_states=True, use_cache=False)
            choices = output.logits[0, tokens.shape[1] - 1 :].argmax(-1)  # k + 1 verdicts
            matches = (choices[:-1] == draft.to(choices.device)).long()
            taken = int(matches.cumprod(0).sum())
            proposed += len(draft)
            accepted += taken
            new = choices[: taken + 1].view(1, -1)
            tokens = torch.cat([tokens, new], dim=1)
            # Keep only what was accepted: the states of rejected drafts are not the sequence's.
            states = tuple(h[:, : tokens.shape[1] - 1] for h in streams.of(output))
        generated = tokens[:, : prompt_length + max_new_tokens]
        if eos_ids:
            produced = generated[0, prompt_length:].tolist()
            for position, token in enumerate(produced):
                if token in eos_ids:
                    generated = generated[:, : prompt_length + position + 1]
                    break
        return generated, proposed, accepted

    def propose_tokens(
        self, verifier_hidden_states: tuple[torch.Tensor, ...], tokens: torch.Tensor, count: int
    ) -> torch.Tensor:
        """`count` draft tokens (target ids) to follow `tokens`; models that can draft override."""
        raise NotImplementedError(f"{type(self).__name__} cannot propose tokens for generate()")


def reload_and_populate_models() -> None:
    """Import every built-in model so the registry knows them all."""
    SpeculatorModel.auto_populate_registry()
