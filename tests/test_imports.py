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
