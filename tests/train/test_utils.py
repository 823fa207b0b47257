"""Data-parallel wrapping: on NCCL, DDP's gradients are still the average over the ranks.

`apply_data_parallel` hands the averaging to NCCL (a comm hook) instead of DDP's own division.
The check needs two CUDA devices (NCCL takes one device per rank); the CPU (gloo) path is covered
by `test_distributed.py`.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.training_fixtures import free_port, gloo_group

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def _rows(rank: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + rank))


def _ddp_gradients_equal_the_average(rank: int, port: int) -> None:
    from speculators_vllm016.train.utils import apply_data_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        model.to(device)
        wrapped = apply_data_parallel(model, device)
        wrapped(_rows(rank).to(device)).square().sum().backward()

        # Both ranks' losses on one unwrapped copy, averaged: what DDP must give every rank.
        def plain(x: torch.Tensor) -> torch.Tensor:
            w1, b1, w2, b2 = reference
            return torch.tanh(x @ w1.T + b1) @ w2.T + b2

        ((plain(_rows(0)).square().sum() + plain(_rows(1)).square().sum()) / 2).backward()
        for parameter, expected in zip(model.parameters(), reference, strict=True):
            torch.testing.assert_close(parameter.grad.cpu(), expected.grad)
    finally:
        dist.destroy_process_group()


@needs_two_gpus
def test_ddp_on_nccl_averages_the_gradients_of_the_ranks():
    mp.spawn(_ddp_gradients_equal_the_average, args=(free_port(),), nprocs=2, join=True)


def _sharded_draft_step(
    rank: int, port: int, verifier: str, out: str, param_dtype: torch.dtype | None = None
) -> None:
    """One forward and backward of a tiny Eagle3 draft under `apply_fully_sharded` (gloo, CPU),
    counting FSDP2's collectives; rank 0 saves the averaged gradients and the counts, and the
    dtypes the layer's weights had in the forward pass and keep between steps."""
    from speculators_vllm016.train.utils import apply_fully_sharded
    from tests.models.test_eagle3 import batch, draft_model

    calls = {"reduce_scatter": 0, "all_gather": 0}
    reduced_sizes: list[int] = []  # each reduce-scatter's input numel, in the order issued

    def counted(name, collective):
        def call(*args, **kwargs):
            calls[name] += 1
            if name == "reduce_scatter":
                reduced_sizes.append((args[1] if len(args) > 1 else kwargs["input"]).numel())
            return collective(*args, **kwargs)

        return call

    with gloo_group(rank, port):
        dist.reduce_scatter_tensor = counted("reduce_scatter", dist.reduce_scatter_tensor)
        dist.all_gather_into_tensor = counted("all_gather", dist.all_gather_into_tensor)
        model = apply_fully_sharded(draft_model(verifier), param_dtype)
        seen = set()
        model.layers[0].register_forward_pre_hook(
            lambda module, args: seen.update(
                p.dtype for p in module.parameters() if p.requires_grad
            )
        )
        for _step in range(2):  # the second step starts from the switches the first one left
            model.zero_grad(set_to_none=True)
            before = dict(calls)
            reduced_sizes.clear()
            model(**batch(seed=rank), ttt_steps=3, ttt_step_loss_decay=0.8).loss.backward()
            per_step = {name: calls[name] - before[name] for name in calls}
        grads = {
            name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None
        }
        if rank == 0:
            kept = {p.dtype for p in model.parameters() if p.requires_grad}
            torch.save(
                {
                    "grads": grads,
                    "per_step": per_step,
                    "gathered": seen,
                    "kept": kept,
                    "reduced_sizes": reduced_sizes,
                },
                out,
            )
        del model  # its device mesh holds the group
        gc.collect()


@pytest.mark.slow
def test_fully_sharded_draft_reduces_each_layer_once_a_step(tiny_llama, tmp_path):
    """A draft layer runs once per TTT step; FSDP2 must still gather its weights once and
    reduce-scatter its gradients once a step (not once per call); the draft head's gradient is
    reduce-scattered first, before the layer's backward pass ends (so the two overlap); and the
    gradients are the average of what each rank's batch gives an unsharded copy."""
    from tests.models.test_eagle3 import batch, draft_model

    out = tmp_path / "sharded.pt"
    mp.spawn(
        _sharded_draft_step, args=(free_port(), str(tiny_llama), str(out)), nprocs=2, join=True
    )
    saved = torch.load(out)
    # One unit per decoder layer, the draft head and the root (fc, norm): one gather, one
    # reduce each.
    assert saved["per_step"] == {"reduce_scatter": 3, "all_gather": 3}
    reference = draft_model(str(tiny_llama))
    vocab, hidden = reference.lm_head.weight.shape
    layer_size = sum(p.numel() for p in reference.layers[0].parameters() if p.requires_grad)
    head_size = -(-vocab // 2) * 2 * hidden  # rows padded to a multiple of the 2 ranks
    assert saved["reduced_sizes"][0] == head_size
    assert saved["reduced_sizes"][1] >= layer_size
    losses = [
        reference(**batch(seed=rank), ttt_steps=3, ttt_step_loss_decay=0.8).loss
        for rank in range(2)
    ]
    (sum(losses) / 2).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert sorted(saved["grads"]) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_fully_sharded_draft_can_gather_bf16_copies_of_its_fp32_weights(tiny_llama, tmp_path):
    """`param_dtype=bf16`: the layer computes with bf16 weights, the sharded masters and their
    gradients stay fp32, the collectives are as many, and the gradients are those of a bf16 copy
    of the draft (averaged over the two ranks' batches)."""
    from tests.models.test_eagle3 import batch, draft_model

    out = tmp_path / "sharded.pt"
    mp.spawn(
        _sharded_draft_step,
        args=(free_port(), str(tiny_llama), str(out), torch.bfloat16),
        nprocs=2,
        join=True,
    )
    saved = torch.load(out)
    assert saved["gathered"] == {torch.bfloat16} and saved["kept"] == {torch.float32}
    assert saved["per_step"] == {"reduce_scatter": 3, "all_gather": 3}
    reference = draft_model(str(tiny_llama))
    for parameter in reference.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.bfloat16()

    def bf16_batch(seed: int) -> dict:  # FSDP2 casts the floating inputs of the forward too
        return {
            key: value.bfloat16() if value.is_floating_point() else value
            for key, value in batch(seed=seed).items()
        }

    losses = [
        reference(**bf16_batch(rank), ttt_steps=3, ttt_step_loss_decay=0.8).loss
        for rank in range(2)
    ]
    (sum(losses) / 2).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert sorted(saved["grads"]) == sorted(expected)
    for name, grad in expected.items():
        assert saved["grads"][name].dtype == torch.float32, name
        torch.testing.assert_close(
            saved["grads"][name], grad.float(), rtol=2e-2, atol=2e-3, msg=name
        )
