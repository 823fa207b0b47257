"""Registries, auto-import and pydantic helpers shared by configs and models."""

from speculators_vllm016.utils.auto_importer import AutoImporterMixin
from speculators_vllm016.utils.pydantic_utils import PydanticClassRegistryMixin, ReloadableBaseModel
from speculators_vllm016.utils.registry import ClassRegistryMixin

__all__ = [
    "AutoImporterMixin",
    "ClassRegistryMixin",
    "PydanticClassRegistryMixin",
    "ReloadableBaseModel",
]
