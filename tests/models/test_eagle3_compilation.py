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
from speculators_vllm016.models.eagle3.model_definitions import (
    maybe_compiled,
    use_reproducible_compilation,
)

pytestmark = pytest.mark.slow


def _column_statistics(
    states: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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
        states = torch.randn(
            length, 256, generator=torch.Generator().manual_seed(length)
        ).bfloat16()
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


@pytest.mark.parametrize("scored", ["random", "all"])
def test_a_shorter_row_after_a_longer_one_compiles_nothing(tiny_llama, scored) -> None:
    """The trainer pads every flex row to its --total-seq-len (`flex_row_length`), so the blocks
    compiled in the first step serve the epoch's shorter last row as they are: no recompile
    (counted by dynamo), where unpadded rows of a new length compiled again. `all`: with every
    position scored the full row runs its layers over all positions; its padding must not send
    the shorter row down the other path (over a subset of them), which compiled anew."""
    from torch._dynamo.utils import counters

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tests.models.test_eagle3 import DRAFT_VOCAB, batch, eagle3_config

    torch._dynamo.reset()
    model_definitions._COMPILED.clear()
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, DRAFT_VOCAB, 512
    )
    draft = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    draft.attention_backend, draft.compile_blocks = "flex", True
    draft.skip_unscored_rows = draft.skip_unused_positions = True  # as on a GPU
    draft.flex_row_length = 256

    def compiled_graphs(length: int, lengths: list[int], seed: int) -> int:
        before = counters["stats"]["unique_graphs"]
        data = {**batch(length, seed=seed), "lengths": torch.tensor(lengths)}
        if scored == "all":
            data["loss_mask"] = torch.ones_like(data["loss_mask"])
        draft(**data, ttt_steps=3).loss.backward()
        return counters["stats"]["unique_graphs"] - before

    try:
        assert compiled_graphs(250, [130, 120], seed=1) > 0  # the first row compiles the blocks
        assert compiled_graphs(90, [50, 40], seed=2) == 0  # the shorter last row: nothing
    finally:
        torch._dynamo.reset()
        model_definitions._COMPILED.clear()


def test_rows_of_new_used_position_counts_compile_nothing_after_the_first(tiny_llama) -> None:
    """Rows whose loss masks leave few positions used run each step's layer over that subset
    (`ScoringPass.select_used_positions`); every step and row has its own subset size. On an
    H100 the first such row, epoch 0's shorter last one, compiled the layer's blocks again for
    the subset's length (6.8 s): they must be symbolic in the row length from the first, dense
    row on, so that no sparse row compiles anything (counted by dynamo)."""
    from torch._dynamo.utils import counters

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tests.models.test_eagle3 import DRAFT_VOCAB, batch, eagle3_config

    torch._dynamo.reset()
    model_definitions._COMPILED.clear()
    torch.manual_seed(0)
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, DRAFT_VOCAB, 512
    )
    draft = Eagle3DraftModel(eagle3_config(str(tiny_llama)), t2d=t2d, d2t=d2t)
    draft.attention_backend, draft.compile_blocks = "flex", True
    draft.skip_unscored_rows = draft.skip_unused_positions = True  # as on a GPU
    draft.flex_row_length = 256

    def compiled_graphs(spans: list[tuple[int, int]], seed: int) -> int:
        before = counters["stats"]["unique_graphs"]
        data = {**batch(250, seed=seed), "lengths": torch.tensor([130, 120])}
        mask = torch.zeros_like(data["loss_mask"])
        for start, end in spans:  # answer turns: the rest is prompt
            mask[0, start:end] = 1
        data["loss_mask"] = mask
        draft(**data, ttt_steps=3).loss.backward()
        return counters["stats"]["unique_graphs"] - before

    try:
        assert compiled_graphs([(0, 250)], seed=1) > 0  # a dense row: every position runs
        assert compiled_graphs([(20, 90), (150, 200)], seed=2) == 0  # the subset path
        assert compiled_graphs([(10, 60), (140, 230)], seed=3) == 0  # other counts
    finally:
        torch._dynamo.reset()
        model_definitions._COMPILED.clear()
