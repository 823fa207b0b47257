"""Process-group set-up and model wrapping for data-parallel training (GPU or CPU).

Launched by `torchrun` (LOCAL_RANK, RANK, WORLD_SIZE in the environment) the trainer joins a
process group: NCCL on CUDA devices, gloo on CPUs. Launched as a plain process it trains alone.
Nothing here assumes `cuda:0`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "apply_data_parallel",
    "apply_fully_sharded",
    "maybe_destroy_distributed",
    "maybe_setup_distributed",
    "training_device",
]

logger = logging.getLogger("speculators")


def _launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def training_device(local_rank: int = 0, requested: str | None = None) -> torch.device:
    """The device this rank trains on: `requested`, else its CUDA device, else the CPU."""
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def maybe_setup_distributed(device: str | None = None) -> tuple[int, int, int, bool]:
    """Join the process group when launched by torchrun: `(local_rank, world_size, rank, is_distributed)`."""
    if not _launched_by_torchrun():
        return 0, 1, 0, False
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        target = training_device(local_rank, device)
        if target.type == "cuda":
            torch.cuda.set_device(target)
            dist.init_process_group("nccl", device_id=target)
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank()
    logger.info("rank %d of %d (local rank %d) joined", rank, world_size, local_rank)
    return local_rank, world_size, rank, True


def maybe_destroy_distributed() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def apply_fully_sharded(
    model: torch.nn.Module, param_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Shard the draft with FSDP2: each decoder layer, the draft LM head, then the rest.

    By default the weights are gathered in their dtype (fp32 master weights) and bf16 compute
    comes from autocast, so the numerics match single-process and DDP training.
    `param_dtype=torch.bfloat16` gathers bf16 copies instead (FSDP2's mixed precision: half the
    gather traffic and no gathered fp32 copies; gradients still reduced and accumulated in fp32).
    Matrix products see the same bf16 weights as under autocast, but the norms then scale by
    bf16 weights too, so losses differ from one-process training in the last digits.
    The model must already be on its device with
    its weights loaded: nothing is re-initialised here (0.3.0 reset the shared weights).
    Frozen parameters (the verifier's embeddings, norm and head) stay whole on every rank: they
    get no gradient or optimizer state to shard, gathering the 1 GB embedding table at every use
    would cost more than it saves, and they may be stored in another dtype than the rest.

    Overlap: the root gathers the layers and the head as soon as it has its own weights (they
    arrive while the root's first matrix products run), and a `DraftLMHead` reduce-scatters
    its gradient as soon as the loss has handed it over, at the start of the backward pass,
    instead of with the root's at its end.
    """
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from speculators_vllm016.models.eagle3.core import DraftLMHead

    layers = getattr(model, "layers", None)
    if layers is None:
        raise InvalidInputError(f"{type(model).__name__} has no `layers` to shard")
    frozen = {parameter for parameter in model.parameters() if not parameter.requires_grad}
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units = []
    head = getattr(model, "lm_head", None)
    if isinstance(head, DraftLMHead) and head.weight.requires_grad:
        # Stays gathered through the forward pass: every TTT step reads it.
        fully_shard(head, reshard_after_forward=False, mp_policy=policy)
        register_fsdp_forward_method(head, "mark_read")
        units.append(head)
    for layer in layers:
        # Each layer runs once per TTT step, forward and backward: resharding after every call
        # would gather its weights 2 x ttt_steps times a step. A draft has one or a few layers,
        # so keeping them gathered until the backward pass costs little memory.
        fully_shard(
            layer, reshard_after_forward=False, ignored_params=frozen or None, mp_policy=policy
        )
        units.append(layer)
    fully_shard(model, ignored_params=frozen or None, mp_policy=policy)
    model.set_modules_to_forward_prefetch(units)
    if head in units:
        # By default the first layer's backward would prefetch what ran forward before it, the
        # head, which is resharded by then: a wasted gather. The root is still gathered there.
        layers[0].set_modules_to_backward_prefetch([model])
    for layer in layers:
        _reduce_once_per_backward(model, layer)
    return model


class _OnBackward(torch.autograd.Function):
    """Identity whose backward first calls `callback`: a hook at the start of one call's backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
        ctx.callback = callback
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.callback()
        return grad, None


def _reduce_once_per_backward(root: torch.nn.Module, layer: torch.nn.Module) -> None:
    """Make FSDP2 reduce-scatter `layer`'s gradients once a backward, not once per TTT step.

    FSDP2 runs its post-backward (reduce-scatter the gradients, reshard) each time the backward
    of one call of a module ends. A draft layer is called once per TTT step, so it would
    reduce-scatter partial gradients ttt_steps times and gather its weights again between the
    calls. The calls' backwards run in reverse order, so the first call's is the last: only it
    reduces and reshards; the later calls' gradients accumulate in the gathered weights' `.grad`
    (what `set_requires_gradient_sync(False)` is for). Public FSDP2 switches only.
    """
    calls_this_forward = 0

    def sync_on_this_backward(sync: bool) -> None:
        layer.set_requires_gradient_sync(sync, recurse=False)
        layer.set_reshard_after_backward(sync, recurse=False)

    def start_of_forward(module: torch.nn.Module, args: Any) -> None:
        nonlocal calls_this_forward
        calls_this_forward = 0
        sync_on_this_backward(True)  # whatever an abandoned backward left

    def after_call(module: torch.nn.Module, args: Any, output: Any) -> Any:
        nonlocal calls_this_forward
        first_call = calls_this_forward == 0
        calls_this_forward += 1
        if not (
            torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
        ):
            return output
        return _OnBackward.apply(output, lambda: sync_on_this_backward(first_call))

    root.register_forward_pre_hook(start_of_forward)
    layer.register_forward_hook(after_call)


def apply_data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Replicate the draft with DDP (gradients averaged across ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device] if device.type == "cuda" else None
    # Gradients live in the communication buckets: no copy in and out of them every step.
    wrapped = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if dist.get_backend(wrapped.process_group) == dist.Backend.NCCL:
        wrapped.register_comm_hook(wrapped.process_group, _average_while_reducing)
    return wrapped


def _average_while_reducing(process_group, bucket):
    """DDP comm hook: NCCL averages inside the all-reduce. DDP's own reduction divides each
    bucket by the world size in a separate pass over all gradients first (about 0.9 ms a step
    at 8B-draft shapes on an H200). Gloo has no average, so CPU runs keep DDP's default.

    Not annotated: DDP checks a hook's annotations against the classes themselves, and this
    module's annotations are strings (`from __future__ import annotations`)."""
    work = dist.all_reduce(
        bucket.buffer(), op=dist.ReduceOp.AVG, group=process_group, async_op=True
    )
    return work.get_future().then(lambda done: done.value()[0])
