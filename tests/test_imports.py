"""The 0.3.0 import paths resolve to this package's very modules."""

from __future__ import annotations

import importlib

import pytest


def test_speculators_is_this_package():
    import speculators
    import speculators_vllm016

    assert speculators is speculators_vllm016


@pytest.mark.parametrize(
    "module",
    [
        "data_generation",
        "data_generation.vllm_hidden_states_generator",
        "data_generation.custom_worker",
        "data_generation.logging_utils",
        "data_generation.preprocessing",
        "data_generation.config_generator",
        "config",
        "model",
        "models.eagle3",
        "models.eagle",
        "convert.eagle.eagle3_converter",
        "proposals.greedy",
        "utils.registry",
        "train.vocab_mapping",
    ],
)
def test_submodules_are_shared(module):
    alias = importlib.import_module(f"speculators.{module}")
    real = importlib.import_module(f"speculators_vllm016.{module}")
    assert alias is real


def test_worker_extension_string_of_0_3_0_resolves():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from speculators_vllm016.data_generation.custom_worker import HiddenStatesWorkerExtension

    cls = resolve_obj_by_qualname(
        "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension"
    )
    assert cls is HiddenStatesWorkerExtension


def test_generator_import_paths():
    from speculators.data_generation import VllmHiddenStatesGenerator as a
    from speculators.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator as b,
    )
    from speculators_vllm016.data_generation import VllmHiddenStatesGenerator as c

    assert a is b is c


# 0.3.0's public names and the module each is defined in.
NAMES_OF_0_3_0 = {
    "speculators": {
        "SpeculatorModel": "model",
        "SpeculatorModelConfig": "config",
        "SpeculatorsConfig": "config",
        "TokenProposalConfig": "config",
        "VerifierConfig": "config",
        "reload_and_populate_configs": "config",
        "reload_and_populate_models": "model",
    },
    "speculators.models": {
        "Eagle3DraftModel": "models.eagle3",
        "Eagle3SpeculatorConfig": "models.eagle3",
        "EagleSpeculator": "models.eagle",
        "EagleSpeculatorConfig": "models.eagle",
        "IndependentSpeculatorConfig": "models.independent",
        "MLPSpeculatorConfig": "models.mlp",
    },
    "speculators.proposals": {"GreedyTokenProposalConfig": "proposals.greedy"},
    "speculators.convert": {"convert_model": "convert.entrypoints"},
}


@pytest.mark.parametrize("package", sorted(NAMES_OF_0_3_0))
def test_public_names_of_0_3_0_are_the_defining_objects(package):
    module = importlib.import_module(package)
    expected = NAMES_OF_0_3_0[package]
    assert set(expected) <= set(module.__all__), set(expected) - set(module.__all__)
    for name, home in expected.items():
        defining = importlib.import_module(f"speculators_vllm016.{home}")
        assert getattr(module, name) is getattr(defining, name), f"{package}.{name}"
        assert getattr(defining, name).__module__.startswith("speculators_vllm016."), name
