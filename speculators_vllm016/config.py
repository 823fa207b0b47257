"""Configs of speculator checkpoints: the `config.json` that vLLM and this library read.

`SpeculatorModelConfig` is both a pydantic model (validation, and the registry that picks the
right subclass from `speculators_model_type`) and a transformers `PretrainedConfig` (so it loads
and saves like any Hugging Face config). `speculators_config` describes the algorithm, the token
proposal methods and the verifier the draft was trained for.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer
from transformers import PretrainedConfig

from speculators_vllm016.utils import PydanticClassRegistryMixin, ReloadableBaseModel
from speculators_vllm016.utils.errors import InvalidInputError, UnsupportedError

__all__ = [
    "DEFAULT_SPECULATIVE_TOKENS",
    "SpeculatorModelConfig",
    "SpeculatorsConfig",
    "TokenProposalConfig",
    "VerifierConfig",
    "default_speculative_tokens",
    "reload_and_populate_configs",
]

# Tokens a draft proposes per round when neither the caller nor its config says (0.3.0's default).
DEFAULT_SPECULATIVE_TOKENS = 3


def _library_version() -> str:
    try:
        return version("speculators-vllm016")
    except PackageNotFoundError:
        return "0.0.0+unknown"


class TokenProposalConfig(PydanticClassRegistryMixin):
    """How the draft proposes tokens and how the verifier accepts them; subclasses per method."""

    @classmethod
    def __pydantic_schema_base_type__(cls) -> type[TokenProposalConfig]:
        # While the class statement runs the name is not bound yet: the class is its own root.
        return globals().get("TokenProposalConfig", cls)

    auto_package: ClassVar[str] = "speculators.proposals"
    registry_auto_discovery: ClassVar[bool] = True
    schema_discriminator: ClassVar[str] = "proposal_type"

    proposal_type: str = Field(description="The registered name of the proposal method.")

    def __init__(self, /, **data: Any) -> None:
        super().__init__(**data)
        if type(self) is TokenProposalConfig:
            self._adopt_registered_fields(data)

    def _adopt_registered_fields(self, data: dict[str, Any]) -> None:
        """`TokenProposalConfig(proposal_type="greedy")` carries greedy's fields, as in 0.3.0.

        0.3.0 validated the base class through its tagged union, so an instance of the base
        held the registered method's fields (given or defaulted) as attributes. They are set
        here as plain attributes: the instance stays a `TokenProposalConfig`, and its dump
        holds `proposal_type` only, as 0.3.0's did.
        """
        if self.registry_auto_discovery and not self.registry_populated:
            type(self).auto_populate_registry()
        method = (self.registry or {}).get(self.proposal_type)
        if method is None or method is TokenProposalConfig:
            return
        validated = method.model_validate(data)
        for name, value in validated.__dict__.items():
            if name not in type(self).model_fields:
                self.__dict__[name] = value


class VerifierConfig(BaseModel):
    """The target model a draft was made for: where to load it and what architecture it has."""

    name_or_path: str | None = Field(description="Hub id or local path of the verifier.")
    architectures: list[str] = Field(description="The verifier's config.json architectures.")
    weights_fingerprint: str | None = Field(
        default=None,
        description="The verifier's final norm and LM head, hashed "
        "(`utils.verifier_weights.verifier_fingerprint`): what `eval` compares with the verifier "
        "it runs. Written only when known (0.3.0's configs have no such key).",
    )

    @model_serializer(mode="wrap")
    def _without_unknown_fingerprint(self, handler: Any) -> dict[str, Any]:
        values = handler(self)
        if values.get("weights_fingerprint") is None:
            values.pop("weights_fingerprint", None)
        return values

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, name_or_path: str | None = "UNSET"
    ) -> VerifierConfig:
        """Build from the verifier's own config; `name_or_path` defaults to where it came from."""
        as_dict = config.to_dict()
        if name_or_path == "UNSET":
            name_or_path = (
                getattr(config, "name_or_path", None)
                or as_dict.get("_name_or_path")
                or as_dict.get("name_or_path")
            )
        return cls(name_or_path=name_or_path, architectures=as_dict.get("architectures") or [])


class SpeculatorsConfig(ReloadableBaseModel):
    """The algorithm a draft implements, its proposal methods and its verifier."""

    algorithm: str = Field(description="The speculative decoding algorithm, e.g. 'eagle3'.")
    proposal_methods: list[TokenProposalConfig] = Field(
        description="Supported token proposal methods."
    )
    default_proposal_method: str = Field(description="The proposal_type used when none is chosen.")
    verifier: VerifierConfig = Field(description="The verifier the draft was trained for.")


# PretrainedConfig attributes that are class-level settings here and must not reach config.json.
_CLASS_ONLY_KEYS = (
    "model_config",
    "auto_package",
    "registry_auto_discovery",
    "schema_discriminator",
    "model_type",
    "base_config_key",
    "sub_configs",
    "is_composition",
    "attribute_map",
    "base_model_tp_plan",
    "base_model_pp_plan",
    "base_model_ep_plan",
    "has_no_defaults_at_init",
    "_auto_class",
)


ForeignLayoutReader = Callable[[dict[str, Any]], "dict[str, Any] | None"]
"""A `config.json` dict of another tool's layout -> this layout's dict, or None."""
_FOREIGN_LAYOUT_READERS: list[ForeignLayoutReader] = []


class SpeculatorModelConfig(PydanticClassRegistryMixin, PretrainedConfig):
    """Base config of every speculator model; `config.json` of a saved draft.

    Loading dispatches on `speculators_model_type` to the registered subclass, so
    `SpeculatorModelConfig.from_pretrained(path)` returns e.g. an `Eagle3SpeculatorConfig`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="allow")

    @classmethod
    def __pydantic_schema_base_type__(cls) -> type[SpeculatorModelConfig]:
        return globals().get("SpeculatorModelConfig", cls)

    auto_package: ClassVar[str] = "speculators.models"
    registry_auto_discovery: ClassVar[bool] = True
    schema_discriminator: ClassVar[str] = "speculators_model_type"

    model_type: ClassVar[str] = "speculator_model"  # type: ignore[misc]
    base_config_key: ClassVar[str] = ""  # type: ignore[misc]
    sub_configs: ClassVar[dict[str, type[PretrainedConfig]]] = {}  # type: ignore[misc]
    is_composition: ClassVar[bool] = False  # type: ignore[misc]
    attribute_map: ClassVar[dict[str, str]] = {}  # type: ignore[misc]
    base_model_tp_plan: ClassVar[dict[str, Any] | None] = None  # type: ignore[misc]
    base_model_pp_plan: ClassVar[dict[str, tuple[list[str]]] | None] = None  # type: ignore[misc]
    # None: save_pretrained must not write an `auto_map` pointing at remote code.
    _auto_class: ClassVar[str | None] = None  # type: ignore[misc]

    speculators_model_type: str = Field(default="", description="Registered model type.")
    speculators_version: str = Field(
        default_factory=_library_version, description="Library version that wrote the config."
    )
    speculators_config: SpeculatorsConfig | None = Field(
        default=None, description="Algorithm, proposal methods and verifier."
    )

    def __init__(self, **kwargs: Any) -> None:
        # Validate the declared fields first, then let PretrainedConfig set its own attributes
        # (which pydantic keeps as extras); the declared fields are passed back so that
        # PretrainedConfig does not reset them to its defaults.
        PydanticClassRegistryMixin.__init__(self, **kwargs)
        for name in type(self).model_fields:
            kwargs[name] = getattr(self, name)
        PretrainedConfig.__init__(self, **kwargs)
        self.transformers_version = version("transformers")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        cache_dir: str | os.PathLike | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        revision: str = "main",
        **kwargs: Any,
    ) -> SpeculatorModelConfig:
        config_dict, kwargs = cls.get_config_dict(
            pretrained_model_name_or_path,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
            revision=revision,
            **kwargs,
        )
        if "speculators_model_type" not in config_dict:
            config_dict = cls._from_foreign_layout(config_dict) or config_dict
        if "speculators_model_type" not in config_dict:
            raise UnsupportedError(
                "Loading a non-speculator model config is not supported yet. "
                f"{pretrained_model_name_or_path} is not a speculator checkpoint (its config "
                "has no speculators_model_type); convert it with `speculators convert` first"
            )
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def register_foreign_layout(cls, reader: ForeignLayoutReader) -> None:
        """Let `from_pretrained` read drafts saved in another tool's layout: `reader` turns such a
        `config.json` dict into this layout's dict, or returns None for configs it does not know.
        Model modules register theirs at import (e.g. the MLA draft's flat vLLM layout)."""
        if reader not in _FOREIGN_LAYOUT_READERS:
            _FOREIGN_LAYOUT_READERS.append(reader)

    @classmethod
    def _from_foreign_layout(cls, config_dict: dict[str, Any]) -> dict[str, Any] | None:
        if cls.registry_auto_discovery:
            cls.auto_populate_registry()  # the model modules register their readers
        for reader in _FOREIGN_LAYOUT_READERS:
            converted = reader(config_dict)
            if converted is not None:
                return converted
        return None

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> SpeculatorModelConfig:
        merged = {**config_dict, **kwargs}
        if "speculators_model_type" not in merged:
            raise InvalidInputError(
                "The config dictionary must contain the 'speculators_model_type' field for "
                "loading a SpeculatorModelConfig in the Speculators library. "
                "a speculator config needs 'speculators_model_type'"
            )
        if cls.registry_auto_discovery:
            cls.auto_populate_registry()
        return cls.model_validate(merged)

    def to_dict(self) -> dict[str, Any]:
        """PretrainedConfig's attributes and the pydantic fields, without class settings."""
        merged = {**PretrainedConfig.to_dict(self), **self.model_dump()}
        for key in _CLASS_ONLY_KEYS:
            merged.pop(key, None)
        return merged

    def to_diff_dict(self) -> dict[str, Any]:
        return super().to_diff_dict()


def default_speculative_tokens(config: PretrainedConfig) -> int:
    """How many tokens a draft proposes when the caller names no count: its first proposal
    method's `speculative_tokens`, else `DEFAULT_SPECULATIVE_TOKENS`."""
    speculators = getattr(config, "speculators_config", None)
    if speculators is None or not speculators.proposal_methods:
        return DEFAULT_SPECULATIVE_TOKENS
    first = speculators.proposal_methods[0]
    return int(getattr(first, "speculative_tokens", DEFAULT_SPECULATIVE_TOKENS))


def reload_and_populate_configs() -> None:
    """Import every built-in config and rebuild the schemas that dispatch on the registries.

    `import speculators` runs this (as 0.3.0 did); call it again after registering your own
    proposal or model configs.
    """
    TokenProposalConfig.auto_populate_registry()
    SpeculatorsConfig.reload_schema()
    SpeculatorModelConfig.auto_populate_registry()
