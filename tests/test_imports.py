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
        "models.eagle3.core",
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


def test_top_level_names_of_0_3_0():
    import speculators

    for name in speculators.__all__:
        assert getattr(speculators, name) is not None, name
    from speculators.models import Eagle3DraftModel, EagleSpeculator, MLPSpeculatorConfig  # noqa: F401
    from speculators.proposals import GreedyTokenProposalConfig  # noqa: F401
    from speculators.convert import convert_model  # noqa: F401
