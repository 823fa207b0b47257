"""Pydantic models whose fields can hold any registered subclass, chosen by a tag field."""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic_core import CoreSchema, SchemaValidator, core_schema

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.registry import ClassRegistryMixin

__all__ = ["PydanticClassRegistryMixin", "ReloadableBaseModel"]

# The root class being constructed directly (`Root(**fields)`): its own validation must fill
# that instance rather than dispatch to a registered subclass.
_CONSTRUCTING: contextvars.ContextVar[type | None] = contextvars.ContextVar(
    "speculators_constructing_root", default=None
)


class ReloadableBaseModel(BaseModel):
    """A model whose validation schema can be rebuilt after new subclasses register."""

    @classmethod
    def reload_schema(cls) -> None:
        cls.model_rebuild(force=True)


class PydanticClassRegistryMixin(ReloadableBaseModel, ABC, ClassRegistryMixin):
    """Validating data as the base class yields the registered subclass its tag names.

    A field typed as the base (e.g. `list[TokenProposalConfig]`) accepts a dict whose
    `schema_discriminator` field ("proposal_type", ...) names a registered subclass and becomes
    an instance of it. The subclass is looked up when the data is validated, not when a schema
    is built, so a model defined before its field's registry was filled still validates into the
    right class (and classes registered later are found without rebuilding anything).
    """

    schema_discriminator: ClassVar[str] = "model_type"
    registry: ClassVar[dict[str, BaseModel] | None] = None  # type: ignore[assignment]

    @classmethod
    def register_decorator(cls, clazz: type[BaseModel], name: str | None = None) -> type[BaseModel]:
        if not (isinstance(clazz, type) and issubclass(clazz, BaseModel)):
            raise TypeError(
                f"Cannot register {getattr(clazz, '__name__', clazz)} as it is not a subclass of "
                f"Pydantic BaseModel. Only pydantic models can be registered on {cls.__name__}"
            )
        return super().register_decorator(clazz, name=name)

    @classmethod
    @abstractmethod
    def __pydantic_schema_base_type__(cls) -> type[Any]:
        """The root of the registry hierarchy: validating as it dispatches on the tag.

        Each root class returns itself for itself and for its subclasses.
        """

    @classmethod
    def __pydantic_generate_base_schema__(cls, handler: GetCoreSchemaHandler) -> CoreSchema:
        """What the root accepts while nothing is registered: anything, unchanged."""
        return core_schema.any_schema()

    def __init__(self, /, **data: Any) -> None:
        constructing = None
        if type(self) is type(self).__pydantic_schema_base_type__():
            constructing = _CONSTRUCTING.set(type(self))
        try:
            super().__init__(**data)
        finally:
            if constructing is not None:
                _CONSTRUCTING.reset(constructing)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source_type: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        if source_type is not cls.__pydantic_schema_base_type__():
            return handler(cls)
        root = source_type
        try:
            unregistered: Callable[[Any], Any] | None = SchemaValidator(
                cls.__pydantic_generate_base_schema__(handler)
            ).validate_python
        except Exception:  # noqa: BLE001 - a base schema that needs its definitions: validate as the root
            unregistered = None

        def dispatch(value: Any, as_root: Callable[[Any], Any]) -> Any:
            if _CONSTRUCTING.get() is root:
                _CONSTRUCTING.set(None)  # fields nested inside dispatch as usual
                return as_root(value)
            return root._validate_as_registered(value, unregistered or as_root)

        def serialize(value: Any, as_root: Callable[[Any], Any], info: Any) -> Any:
            # By the runtime class, so a registered subclass keeps its own fields.
            if type(value) is root or not isinstance(value, BaseModel):
                return as_root(value)
            return value.model_dump(
                mode=info.mode,
                by_alias=bool(info.by_alias),
                exclude_unset=info.exclude_unset,
                exclude_defaults=info.exclude_defaults,
                exclude_none=info.exclude_none,
                round_trip=info.round_trip,
            )

        own_schema = handler(cls)
        return core_schema.no_info_wrap_validator_function(
            dispatch,
            own_schema,
            serialization=core_schema.wrap_serializer_function_ser_schema(
                serialize, schema=own_schema, info_arg=True
            ),
        )

    @classmethod
    def _validate_as_registered(
        cls, value: Any, validate_unregistered: Callable[[Any], Any]
    ) -> Any:
        """The registered subclass named by `value`'s tag, validated from `value`."""
        if isinstance(value, cls):
            return value
        if cls.registry_auto_discovery and not cls.registry_populated:
            cls.auto_populate_registry()
        if not cls.registry:
            return validate_unregistered(value)
        discriminator = cls.schema_discriminator
        if isinstance(value, Mapping):
            tag = value.get(discriminator)
        else:
            tag = getattr(value, discriminator, None)
        subclass = cls.registry.get(tag) if isinstance(tag, str) else None
        if subclass is None:
            raise InvalidInputError(
                f"{discriminator}={tag!r} names no registered {cls.__name__}; "
                f"use one of {sorted(cls.registry)}"
            )
        return subclass.model_validate(value)

    @classmethod
    def auto_populate_registry(cls) -> bool:
        populated = super().auto_populate_registry()
        cls.reload_schema()
        return populated
