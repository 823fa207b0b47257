"""A name -> class registry that subclasses fill with a decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from speculators_vllm016.utils.auto_importer import AutoImporterMixin
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["ClassRegistryMixin"]


class ClassRegistryMixin(AutoImporterMixin):
    """`@Base.register("name")` records a class under a name on `Base.registry`.

    With `registry_auto_discovery`, the first look-up imports `auto_package` so that every
    implementation shipped in it is registered.
    """

    registry: ClassVar[dict[str, type[Any]] | None] = None
    registry_auto_discovery: ClassVar[bool] = False
    registry_populated: ClassVar[bool] = False

    @classmethod
    def register(cls, name: str | None = None) -> Callable[[type[Any]], type[Any]]:
        if name is not None and not isinstance(name, str):
            raise InvalidInputError(
                "ClassRegistryMixin.register() name must be a string or None. "
                f"{cls.__name__}.register() got {name!r}"
            )
        return lambda clazz: cls.register_decorator(clazz, name=name)

    @classmethod
    def register_decorator(cls, clazz: type[Any], name: str | None = None) -> type[Any]:
        if not isinstance(clazz, type):
            raise TypeError(
                "ClassRegistryMixin.register_decorator must be used as a class decorator and "
                f"without invocation. {cls.__name__}.register_decorator got {clazz!r}, not a class"
            )
        if name is None or name == "":
            name = clazz.__name__
        if not isinstance(name, str):
            raise InvalidInputError(
                "ClassRegistryMixin.register_decorator must be used as a class decorator and "
                f"without invocation. Registry names are strings, got {name!r}"
            )
        if cls.registry is None:
            cls.registry = {}
        existing = cls.registry.get(name)
        if existing is not None and existing is not clazz:
            raise InvalidInputError(
                f"{name!r} is already registered on {cls.__name__} to {existing}"
            )
        cls.registry[name] = clazz
        return clazz

    @classmethod
    def auto_populate_registry(cls) -> bool:
        """Import `auto_package` once; True if this call did the import."""
        if not cls.registry_auto_discovery:
            raise InvalidInputError(
                "ClassRegistryMixin.auto_populate_registry() cannot be called because "
                f"registry_auto_discovery is set to False. {cls.__name__} does not auto-discover; "
                "set registry_auto_discovery = True on it"
            )
        if cls.registry_populated:
            return False
        cls.auto_import_package_modules()
        cls.registry_populated = True
        return True

    @classmethod
    def registered_classes(cls) -> tuple[type[Any], ...]:
        if cls.registry_auto_discovery:
            cls.auto_populate_registry()
        if cls.registry is None:
            raise InvalidInputError(
                "ClassRegistryMixin.registered_classes() must be called after registering "
                f"classes with ClassRegistryMixin.register(). Nothing is registered on "
                f"{cls.__name__} yet"
            )
        return tuple(cls.registry.values())
