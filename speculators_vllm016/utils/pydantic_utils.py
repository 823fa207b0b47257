"""Pydantic models whose fields can hold any registered subclass, chosen by a tag field."""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

from speculators_vllm016.utils.registry import ClassRegistryMixin

__all__ = ["PydanticClassRegistryMixin", "ReloadableBaseModel"]


class ReloadableBaseModel(BaseModel):
    """A model whose validation schema can be rebuilt after new subclasses register."""

    @classmethod
    def reload_schema(cls) -> None:
        cls.model_rebuild(force=True)


class PydanticClassRegistryMixin(ReloadableBaseModel, ABC, ClassRegistryMixin):
    """Validating data as the base class yields the registered subclass its tag names.

    A field typed as the base (e.g. `list[TokenProposalConfig]`) validates into a tagged union of
    every registered subclass, keyed by `schema_discriminator` ("proposal_type", ...).
    """

    schema_discriminator: ClassVar[str] = "model_type"
    registry: ClassVar[dict[str, BaseModel] | None] = None  # type: ignore[assignment]

    @classmethod
    def register_decorator(cls, clazz: type[BaseModel], name: str | None = None) -> type[BaseModel]:
        if not (isinstance(clazz, type) and issubclass(clazz, BaseModel)):
            raise TypeError(f"{clazz!r} is not a pydantic model and cannot be registered")
        return super().register_decorator(clazz, name=name)

    @classmethod
    def __pydantic_schema_base_type__(cls) -> type[Any]:
        """The root of this registry hierarchy: the class that declares the discriminator.

        Validating as the root yields the tagged union; a subclass validates as itself.
        """
        for klass in cls.__mro__:
            # The mixin itself (defined in this module) declares a default, not a hierarchy.
            if "schema_discriminator" in vars(klass) and klass.__module__ != __name__:
                return klass
        return cls

    @classmethod
    def __pydantic_generate_base_schema__(cls, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.any_schema()

    @classmethod
    def __get_pydantic_core_schema__(cls, source_type: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        if source_type is cls.__pydantic_schema_base_type__():
            if not cls.registry:
                return cls.__pydantic_generate_base_schema__(handler)
            choices = {name: handler(subclass) for name, subclass in cls.registry.items()}
            return core_schema.tagged_union_schema(
                choices=choices, discriminator=cls.schema_discriminator
            )
        return handler(cls)

    @classmethod
    def auto_populate_registry(cls) -> bool:
        populated = super().auto_populate_registry()
        cls.reload_schema()
        return populated
