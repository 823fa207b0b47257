"""Compiled blocks whose numbers do not depend on the shapes compiled before (`--deterministic`).

A resumed run compiles its first step afresh, for that step's shapes; an uninterrupted run
reached the same step with kernels recompiled for symbolic lengths. After
`use_reproducible_compilation` the two must agree bit for bit. On the H200 the default made a
resumed run's weights drift by 2e-5 within a few steps (`benchmarks/trainer_gpu.py
--resume-check`); on a CPU the draft's own blocks happen to agree at test sizes, so the test
compiles a block with a reduction over the row dimension, where the CPU kernels differ too.
"""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.models.eagle3 import model_definitions
from speculators_vllm016.models.eagle3.model_definitions import maybe_compiled, use_reproducible_compilation

pytestmark = pytest.mark.slow


def _column_statistics(states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block that sums over the rows, the dimension whose length changes from row to row."""
    wide = states.float()
    return (wide * weight).sum(0).softmax(-1), (wide * wide).sum(0)


def _after(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output for rows of the last length, after calls with the others, compiled afresh."""
    torch._dynamo.reset()
    model_definitions._COMPILED.clear()
    block = maybe_compiled(_column_statistics, True)
    weight = torch.randn(256, generator=torch.Generator().manual_seed(0))
    for length in lengths:
        states = torch.randn(length, 256, generator=torch.Generator().manual_seed(length)).bfloat16()
        output = block(states, weight)
    return output


@pytest.fixture
def reproducible():
    use_reproducible_compilation(True)
    yield
    use_reproducible_compilation(False)
    torch._dynamo.reset()


def test_a_block_computes_the_same_bits_whatever_was_compiled_before(reproducible) -> None:
    after_another, alone = _after([3001, 7777]), _after([7777])
    for first, second in zip(after_another, alone, strict=True):
        assert torch.equal(first, second), (first - second).abs().max()


def test_switching_back_restores_inductors_setting() -> None:
    import torch._inductor.config as inductor_config

    before = inductor_config.deterministic
    use_reproducible_compilation(True)
    assert inductor_config.deterministic is True and model_definitions._REPRODUCIBLE
    use_reproducible_compilation(False)
    assert inductor_config.deterministic == before and not model_definitions._REPRODUCIBLE
