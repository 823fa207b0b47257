"""The EAGLE-3 training step's GPU-only paths against their plain versions, on a CUDA device
(skipped elsewhere: CI has no GPU). Compiled blocks and flex attention as in training."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _step(model, batch, *, skip: bool, embeddings_need_grad: bool = False, unused: bool = False):
    """Loss, parameter gradients (fp32) and draft tokens of one forward/backward under bf16."""
    model.skip_unscored_rows = skip
    model.skip_unused_positions = unused
    model.zero_grad(set_to_none=True)
    embed = model.embed_tokens.forward
    if embeddings_need_grad:  # sends the first layer's q/k/v through the generic projection
        model.embed_tokens.forward = lambda ids: embed(ids).detach().requires_grad_(True)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch, ttt_steps=3)
        out.loss.backward()
    finally:
        model.embed_tokens.forward = embed
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, [tokens.clone() for tokens in out.draft_tokens]


def _draft_and_row(tokens: int, arch: str = "llama"):
    """The `cpu-small` preset's draft on the GPU in training mode (seed 0), and a synthetic
    packed row of `tokens` tokens for it. `arch="mla"`: the MLA layer's draft of that size
    (`benchmarks/step_profile.py`'s, shaped from a DeepSeek-V3 text config)."""
    from benchmarks.step_profile import build_draft
    from benchmarks.training import PRESETS, build_model, synthetic_batch

    device = torch.device("cuda")
    preset = PRESETS["cpu-small"]
    torch.manual_seed(0)
    if arch == "llama":
        model = build_model(preset, device, torch.bfloat16, "auto", None)
    else:
        model = build_draft(preset, arch, device, tokens)
    model.train()
    return model, synthetic_batch(preset, tokens, device, torch.bfloat16)


def _worst_relative_difference(left: dict, right: dict) -> float:
    assert left.keys() == right.keys()
    return max(float((left[n] - right[n]).norm() / right[n].norm()) for n in left)


def test_gpu_paths_match_the_plain_computation():
    model, batch = _draft_and_row(1024)
    _step(model, batch, skip=False)  # compiles
    full_loss, full_grads, full_tokens = _step(model, batch, skip=False)
    again_loss, again_grads, _ = _step(model, batch, skip=False)
    assert torch.equal(again_loss, full_loss)
    assert _worst_relative_difference(again_grads, full_grads) == 0.0  # repeatable to the bit
    variants = (
        {"skip": True},
        {"skip": False, "embeddings_need_grad": True},
        {"skip": True, "unused": True},
    )
    for variant in variants:
        loss, grads, tokens = _step(model, batch, **variant)
        torch.testing.assert_close(loss, full_loss, rtol=1e-3, atol=1e-4, msg=str(variant))
        # bf16 compute: the gradients agree to bf16 rounding, not to the bit
        assert _worst_relative_difference(grads, full_grads) < 2e-2, variant
        for mine, theirs in zip(tokens, full_tokens, strict=True):
            computed = mine != -1  # skipped positions: -1 (the last step skips about 30%)
            assert torch.equal(mine[computed], theirs[computed]), variant
        assert 0 < int((tokens[-1] == -1).sum()) < tokens[-1].numel() // 2 or not variant.get(
            "unused"
        )


def test_sparse_rows_compile_nothing_and_dense_rows_keep_their_bits(monkeypatch):
    """Issue #48 item 2 on CUDA: after a dense row, rows whose layers run over subsets of their
    positions (new lengths every step and row) compile nothing, since the layer's blocks are
    compiled symbolic in the row length (`symbolic_dims.mark_rows`). Against the blocks compiled for the
    dense row's fixed length (before), its loss keeps every bit; its fp32 gradients may differ in
    the last bit (on an H100, 8.1e-8 relative at worst: the symbolic kernels sum in another
    order), so they are held to 1e-6, far below what one bf16 step moves them."""
    from torch._dynamo.utils import counters

    from benchmarks.training import PRESETS, build_model, synthetic_batch
    from speculators_vllm016.models.eagle3 import model_definitions, symbolic_dims

    device = torch.device("cuda")
    preset = PRESETS["cpu-small"]
    torch.manual_seed(0)
    model = build_model(preset, device, torch.bfloat16, "auto", None)
    model.train()
    model.flex_row_length = 1024
    dense = synthetic_batch(preset, 1000, device, torch.bfloat16)
    dense["loss_mask"] = torch.ones_like(dense["loss_mask"])

    def fresh_dense_step():
        torch._dynamo.reset()
        model_definitions._COMPILED.clear()
        return _step(model, dense, skip=True, unused=True)

    try:
        with monkeypatch.context() as fixed_length:
            fixed_length.setattr(  # the row blocks compiled for fixed lengths, as before
                symbolic_dims,
                "_REGISTERED",
                {
                    block: marks
                    for block, marks in symbolic_dims._REGISTERED.items()
                    if marks is not symbolic_dims.mark_rows
                },
            )
            before_loss, before_grads, _ = fresh_dense_step()
        loss, grads, _ = fresh_dense_step()
        assert torch.equal(loss, before_loss)
        assert _worst_relative_difference(grads, before_grads) <= 1e-6
        for seed, spans in ((1, ((100, 300), (600, 700))), (2, ((50, 450),))):
            sparse = synthetic_batch(preset, 1000, device, torch.bfloat16, seed=seed)
            sparse["loss_mask"] = torch.zeros_like(sparse["loss_mask"])
            for start, end in spans:
                sparse["loss_mask"][0, start:end] = 1
            graphs = counters["stats"]["unique_graphs"]
            _, _, tokens = _step(model, sparse, skip=True, unused=True)
            assert int((tokens[0] == -1).sum()) > 100  # the subset path ran
            assert counters["stats"]["unique_graphs"] == graphs, spans
    finally:
        torch._dynamo.reset()
        model_definitions._COMPILED.clear()


def test_a_device_snapshot_reaches_the_host_bit_for_bit():
    """A checkpoint's device snapshot comes to the host through two page-locked buffers, in
    chunks, on the writer's stream (`background_writer.to_host`): every tensor of the tree,
    whatever its size against the chunk, must arrive unchanged."""
    from speculators_vllm016.train.checkpointing import background_writer
    from speculators_vllm016.train.checkpointing.background_writer import stage, to_host

    generator = torch.Generator(device="cuda").manual_seed(0)
    chunk = background_writer.HOST_CHUNK_BYTES // 4
    tree = {
        "weights": {
            "big": torch.randn(chunk * 2 + 5, device="cuda", generator=generator),
            "bf16": torch.randn(3, 1000, device="cuda", generator=generator).bfloat16(),
        },
        "state": {"step": torch.tensor(7, device="cuda"), "note": "kept"},
    }
    expected = {name: tensor.cpu() for name, tensor in tree["weights"].items()}
    staged = stage(tree)
    assert staged.on_device
    for tensor in tree["weights"].values():  # the loop goes on: the snapshot must not move
        tensor.add_(1)
    host = to_host(staged)
    assert host["state"]["note"] == "kept" and int(host["state"]["step"]) == 7
    for name, tensor in expected.items():
        assert host["weights"][name].device.type == "cpu"
        assert torch.equal(host["weights"][name], tensor), name


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_every_ttt_step_runs_one_flex_kernel_with_the_same_bits(monkeypatch, arch):
    """Keys padded to the last TTT step's length (`attention.key_capacity`, the TTT steps' cache
    holding them padded): flex compiles once for all steps, and the step's loss, gradients and
    draft tokens are those of unpadded keys (the padded key blocks are listed nowhere in the
    mask, so the kernel never reads them). Both layer kinds: the MLA layer's keys and values
    (of different head sizes) go through the same cache."""
    from torch._dynamo.utils import counters

    from speculators_vllm016.models.eagle3 import core, model_definitions

    def fresh_step(capacity: bool):
        torch._dynamo.reset()
        model_definitions._COMPILED.clear()
        if not capacity:
            monkeypatch.setattr(core, "key_capacity", lambda mask, steps: {})
        before = counters["stats"]["unique_graphs"]
        _step(model, batch, skip=False)  # compiles
        graphs = counters["stats"]["unique_graphs"] - before
        monkeypatch.undo()
        return graphs, _step(model, batch, skip=False)

    model, batch = _draft_and_row(1024, arch)
    plain_graphs, (plain_loss, plain_grads, plain_tokens) = fresh_step(capacity=False)
    padded_graphs, (loss, grads, tokens) = fresh_step(capacity=True)
    assert padded_graphs == plain_graphs - 1  # flex's second, symbolic-key-length graph is gone
    assert torch.equal(loss, plain_loss)
    assert _worst_relative_difference(grads, plain_grads) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(tokens, plain_tokens, strict=True))
