"""Import every module of a package so that classes registering themselves at import appear."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import ClassVar

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["AutoImporterMixin"]


class AutoImporterMixin:
    """Classes naming `auto_package` can import all its modules on demand.

    Used by registries: model and config classes register themselves when their module is
    imported, so importing the package tree once makes every implementation discoverable.
    """

    auto_package: ClassVar[str | tuple[str, ...] | None] = None
    auto_ignore_modules: ClassVar[tuple[str, ...] | None] = None
    auto_imported_modules: ClassVar[list | None] = None

    @classmethod
    def auto_import_package_modules(cls) -> None:
        if cls.auto_package is None:
            raise InvalidInputError(
                "The class variable 'auto_package' must be set to the package name to import "
                f"modules from. {cls.__name__}.auto_package is None"
            )
        packages = cls.auto_package if isinstance(cls.auto_package, tuple) else (cls.auto_package,)
        ignored = set(cls.auto_ignore_modules or ())
        imported: list[str] = []
        for package_name in packages:
            package = importlib.import_module(package_name)
            prefix = package.__name__ + "."
            # Unpacked as a 3-tuple (finder, name, ispkg), as 0.3.0 did: code that mocks
            # walk_packages with plain tuples keeps working, and ModuleInfo is a namedtuple.
            for _finder, name, is_package in pkgutil.walk_packages(package.__path__, prefix):
                if is_package or name in ignored or name in imported:
                    continue
                if name not in sys.modules:
                    importlib.import_module(name)
                imported.append(name)
        cls.auto_imported_modules = imported
