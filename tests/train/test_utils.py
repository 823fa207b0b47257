"""Data-parallel wrapping: on NCCL, DDP's gradients are still the average over the ranks.

`apply_data_parallel` hands the averaging to NCCL (a comm hook) instead of DDP's own division.
The check needs two CUDA devices (NCCL takes one device per rank); the CPU (gloo) path is covered
by `test_distributed.py`.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    mp.spawn(_ddp_gradients_equal_the_average, args=(_free_port(),), nprocs=2, join=True)
