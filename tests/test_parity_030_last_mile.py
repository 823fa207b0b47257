"""Compatibility with code written against speculators 0.3.0 (issue 30).

Such code matches on 0.3.0's error sentences (`pytest.raises(match=...)`, `"..." in str(e)`),
patches names in 0.3.0's modules and relies on a few of its behaviours. Our messages keep
0.3.0's sentence first and add ours after it; these tests pin both halves.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal
from unittest import mock

import pytest
from pydantic import BaseModel
from torch import nn

from speculators_vllm016.config import (
    SpeculatorModelConfig,
    SpeculatorsConfig,
    TokenProposalConfig,
    VerifierConfig,
)
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.proposals import GreedyTokenProposalConfig
from speculators_vllm016.utils import PydanticClassRegistryMixin
from speculators_vllm016.utils.auto_importer import AutoImporterMixin
from speculators_vllm016.utils.registry import ClassRegistryMixin

# ------------------------------------------------------------------ registries: wording


class _Registry(ClassRegistryMixin):
    pass


class _AutoRegistry(ClassRegistryMixin):
    registry_auto_discovery: ClassVar[bool] = False


def test_registry_errors_start_with_0_3_0_sentences():
    with pytest.raises(ValueError, match=r"name must be a string or None\. .*got 5"):
        _Registry.register(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be used as a class decorator.*not a class"):
        _Registry.register_decorator("not a class")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be used as a class decorator.*strings, got 7"):
        _Registry.register_decorator(type("X", (), {}), name=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be called after registering classes.*_Registry"):
        _Registry.registered_classes()
    with pytest.raises(ValueError, match="registry_auto_discovery is set to False.*_AutoRegistry"):
        _AutoRegistry.auto_populate_registry()


def test_pydantic_registry_refuses_a_plain_class_in_0_3_0_words():
    class Root(PydanticClassRegistryMixin):
        @classmethod
        def __pydantic_schema_base_type__(cls) -> type:
            return cls

    with pytest.raises(TypeError, match="Cannot register Plain as it is not a subclass of Pydantic"):
        Root.register_decorator(type("Plain", (), {}))

    class Fine(BaseModel):
        pass

    assert Root.register_decorator(Fine) is Fine


# ------------------------------------------------------------- auto-importer: 0.3.0 shape


def test_auto_importer_without_a_package_says_it_must_be_set():
    class NoPackage(AutoImporterMixin):
        pass

    with pytest.raises(ValueError, match="'auto_package' must be set.*NoPackage"):
        NoPackage.auto_import_package_modules()


def test_auto_importer_takes_walk_packages_entries_as_plain_tuples():
    """0.3.0 unpacked (finder, name, ispkg); code that mocks walk_packages gives tuples."""

    class Importer(AutoImporterMixin):
        auto_package = "pkg"
        auto_ignore_modules = ("pkg.skipped",)

    package = mock.MagicMock(__path__=["pkg"], __name__="pkg")
    entries = [(None, "pkg.a", False), (None, "pkg.sub", True), (None, "pkg.skipped", False),
               (None, "pkg.b", False)]
    with (
        mock.patch("pkgutil.walk_packages", return_value=entries),
        mock.patch("importlib.import_module", return_value=package) as import_module,
    ):
        Importer.auto_import_package_modules()
    assert Importer.auto_imported_modules == ["pkg.a", "pkg.b"]
    import_module.assert_any_call("pkg")
