"""How many graphs the compiled blocks of a training step trace (issue #48 item 4: a cold first
step compiles each graph one after another, so every graph saved is seconds saved).

Counted by dynamo on a CPU with its `eager` backend: the graphs and their recompilations are
dynamo's, whatever backend then compiles them (inductor on a GPU)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from speculators_vllm016.models.eagle3 import attention, model_definitions
from speculators_vllm016.models.eagle3.attention import (
    build_step_zero_mask,
    compiled_flex,
    extend_mask_for_draft_tokens,
    key_capacity,
    padded_to_capacity,
)
from speculators_vllm016.models.eagle3.fused_loss import linear_kl_loss
from speculators_vllm016.models.eagle3.packed_row import StepKeyValues


@pytest.fixture
def eager_compile(monkeypatch):
    """`torch.compile` with dynamo's `eager` backend (graphs counted, nothing built), afresh."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    model_definitions._COMPILED.clear()
    yield
    torch._dynamo.reset()
    model_definitions._COMPILED.clear()


def _graphs(run) -> int:
    before = counters["stats"]["unique_graphs"]
    run()
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("scored", ["all", "some"])
def test_the_kl_block_compiles_once_for_the_shorter_last_chunk(eager_compile, scored) -> None:
    """300 rows in chunks of 128: two full chunks, then 44 rows. One graph (the block's), where
    the fixed-count graph of the full chunks compiled again for the last one."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 32, generator=generator, requires_grad=True)
    weight = torch.randn(64, 32, generator=generator, requires_grad=True)
    targets = torch.randn(300, 64, generator=generator)
    row_weights = torch.ones(300)
    scored_rows = None
    if scored == "some":  # the other block: scored rows gathered first
        row_weights[::3] = 0
        scored_rows = int((row_weights != 0).sum())

    def step() -> None:
        loss, _ = linear_kl_loss(
            hidden, weight, targets, row_weights, 128, True, scored_rows=scored_rows
        )
        loss.backward()

    assert _graphs(step) == 1
    assert _graphs(step) == 0


def _ttt_flex_graphs(capacity: bool) -> int:
    """Graphs compiled flex traces over three TTT steps' key lengths (256, 512, 768), the keys
    kept by the TTT steps' cache as the training forward keeps them."""
    length, heads, head_dim, steps = 256, 2, 16, 3
    generator = torch.Generator().manual_seed(0)
    mask = build_step_zero_mask(torch.tensor([100, 156]), length, flex=True)
    kwargs = key_capacity(mask, steps) if capacity else {}
    cache = StepKeyValues(kwargs.get("kv_capacity"))
    query = torch.randn(1, heads, length, head_dim, generator=generator)

    def run() -> None:
        nonlocal mask
        for _ in range(steps):
            new = torch.randn(1, heads, length, head_dim, generator=generator)
            key, value = cache.update(new, new + 1, 0)
            compiled_flex(query, key, value, mask, None, False, kwargs.get("kv_capacity"))
            mask = extend_mask_for_draft_tokens(mask)

    return _graphs(run)


@pytest.fixture
def flex_compiled_here(monkeypatch):
    """`key_capacity` as on a GPU, where flex runs compiled (on a CPU it runs uncompiled)."""
    monkeypatch.setattr(attention, "flex_is_compiled", lambda device: True)


def test_flex_compiles_once_for_every_ttt_step_with_the_keys_padded(
    eager_compile, flex_compiled_here
) -> None:
    assert _ttt_flex_graphs(capacity=True) == 1


def test_without_the_padding_flex_compiles_twice(eager_compile, flex_compiled_here) -> None:
    """What the padding saves: step 1's longer keys recompile flex with a symbolic length."""
    assert _ttt_flex_graphs(capacity=False) == 2


def test_keys_are_not_padded_where_flex_runs_uncompiled() -> None:
    """On a CPU flex runs uncompiled and evaluates `mask_mod` at every key: padded keys would be
    read there, so none are asked for."""
    mask = build_step_zero_mask(torch.tensor([100, 156]), 256, flex=True)
    assert key_capacity(mask, 3) == {}


def test_the_padded_keys_and_mask_match_the_last_step(flex_compiled_here) -> None:
    mask = build_step_zero_mask(torch.tensor([100, 156]), 256, flex=True)
    assert key_capacity(mask, 3) == {"kv_capacity": 768}
    assert key_capacity(mask, 1) == {} and key_capacity(torch.ones(1, 1, 4, 4), 3) == {}
    key = torch.randn(1, 2, 256, 16)
    padded_key, padded_value, padded = padded_to_capacity(key, key + 1, mask, 768)
    assert padded_key.shape == padded_value.shape == (1, 2, 768, 16)
    assert torch.equal(padded_key[:, :, :256], key) and not padded_key[:, :, 256:].any()
    assert padded.seq_lengths == (256, 768) and padded.kv_indices.shape[-1] == 6
    assert torch.equal(padded.kv_num_blocks, mask.kv_num_blocks)  # no padded block is listed
    assert torch.equal(padded.kv_indices[..., :2], mask.kv_indices)
    assert padded.kv_num_blocks._base is None  # a copy, as at the later steps (not a view)
    last = extend_mask_for_draft_tokens(extend_mask_for_draft_tokens(mask))
    whole = key.repeat(1, 1, 3, 1)
    assert padded_to_capacity(whole, whole, last, 768)[2].seq_lengths == (256, 768)
    # Keys the cache padded already: only the mask is widened, the keys are handed on as they are.
    cached = torch.cat([key, torch.zeros(1, 2, 512, 16)], dim=2)
    same_key, same_value, widened = padded_to_capacity(cached, cached, mask, 768)
    assert same_key is cached and same_value is cached and widened.seq_lengths == (256, 768)


def test_a_training_step_compiles_each_block_once_but_normed_twice(eager_compile) -> None:
    """The graphs a Llama-layer draft's first training step traces (flex aside: uncompiled on a
    CPU), by dynamo's count: 10, every block once but `_normed` twice (no-grad in the MLP
    input's forward; with grad for the residual norm and for both recomputations in the
    backward pass, which hand it the norm weight as a parameter, as the forward did: a plain
    tensor traced an 11th graph). A second step traces nothing."""
    from benchmarks.training import PRESETS, build_model, synthetic_batch

    preset = PRESETS["cpu-small"]
    torch.manual_seed(0)
    model = build_model(preset, torch.device("cpu"), torch.float32, "auto", None)
    model.train()
    model.compile_blocks = True
    batch = synthetic_batch(preset, 256, torch.device("cpu"), torch.float32)

    def step() -> None:
        model(**batch, ttt_steps=3).loss.backward()

    assert _graphs(step) == 10
    assert _graphs(step) == 0
