"""The `speculators` import path of 0.3.0, served by `speculators_vllm016`.

`import speculators.X` returns the very module `speculators_vllm016.X` (not a copy), so classes,
registries and `worker_extension_cls` strings written for 0.3.0 resolve to the same objects.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

_ALIAS = "speculators"
_TARGET = "speculators_vllm016"


def _target_name(alias_name: str) -> str:
    return _TARGET + alias_name[len(_ALIAS) :]


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `speculators.*` to the already-importable `speculators_vllm016.*` modules."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        real_spec = importlib.util.find_spec(_target_name(fullname))
        if real_spec is None:
            return None
        is_package = real_spec.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(_target_name(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        """The target module ran when it was imported; nothing is left to execute."""


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

sys.modules[__name__] = importlib.import_module(_TARGET)
