"""Requests and samples between extraction and training ranks, as raw tensors (no pickles).

A training rank asks the extraction rank of a step for its own samples of that step
(`SampleRequest`, 4 int64s) and receives them as one `StepSamples` answer:

    header   int64 [5]              status (0 samples, 1 failure), count, dtype code, layers, hidden
    meta     int64 [2 * count]      (datagen index, tokens) of each sample    | failure: message length
    ids      int64 [sum tokens]     input_ids of the samples, end to end      | failure: uint8 message
    masks    int64 [sum tokens]     loss masks, end to end
    states   dtype [sum of layers x tokens x hidden]  each sample's layers stacked, end to end

Each request gets exactly one answer, in order; a failure answer carries the extraction side's
message. Every byte is counted on both sides (`bytes_moved`).

Requests, headers, ids and masks go over the control group (gloo). The hidden states, nearly all
the bytes, go over the payload group: the same gloo group on CPUs, or an NCCL group where every rank
has a GPU (`payload_device`: the states are staged there on the extraction side, arrive there on
the training side, and are handed to the CPU-side packing from there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DONE",
    "REQUEST",
    "SampleRequest",
    "StepSamples",
    "Transport",
]

REQUEST, DONE = 1, 2
_REQUEST_TAG, _ANSWER_TAG = 11, 12
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OK, _FAILED = 0, 1


@dataclass(frozen=True)
class SampleRequest:
    """What a training rank asks for: its samples of `step` of one loader iteration.

    `iteration` names the loader (0 training, 1 validation) and `epoch` its epoch: with the step,
    that fixes the samples (the sampler's plan), so the extraction side needs no other state."""

    kind: int
    iteration: int = 0
    epoch: int = 0
    step: int = 0
    source: int = -1  # the asking global rank (filled in on receipt)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.kind, self.iteration, self.epoch, self.step], dtype=torch.long)


@dataclass
class StepSamples:
    """One answer: raw samples by datagen index (what `Eagle3SampleFileDataset.item` prepares),
    or the extraction side's failure message."""

    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    failure: str | None = None


class Transport:
    """Point-to-point traffic over the exchange group (`split_groups`), with byte counts."""

    def __init__(
        self, group: Any, payload_group: Any = None, payload_device: torch.device | None = None
    ) -> None:
        self.group = group
        self.payload_group = payload_group if payload_group is not None else group
        self.payload_device = payload_device or torch.device("cpu")
        self.bytes_moved = 0

    # -- training side -------------------------------------------------------------------------
    def request(self, extraction_rank: int, request: SampleRequest) -> None:
        self.group.send([request.to_tensor()], extraction_rank, _REQUEST_TAG).wait()

    def receive_answer(self, extraction_rank: int) -> StepSamples:
        header = self._recv(torch.empty(5, dtype=torch.long), extraction_rank)
        status, count, dtype_code, layers, hidden = (int(value) for value in header)
        if status == _FAILED:
            message = self._recv(torch.empty(count, dtype=torch.uint8), extraction_rank)
            return StepSamples(failure=bytes(message.tolist()).decode(errors="replace"))
        if count == 0:
            return StepSamples()
        meta = self._recv(torch.empty(2 * count, dtype=torch.long), extraction_rank).view(count, 2)
        total = int(meta[:, 1].sum())
        ids = self._recv(torch.empty(total, dtype=torch.long), extraction_rank)
        masks = self._recv(torch.empty(total, dtype=torch.long), extraction_rank)
        states = self._recv(
            torch.empty(
                total * layers * hidden, dtype=_DTYPES[dtype_code], device=self.payload_device
            ),
            extraction_rank,
            self.payload_group,
        ).cpu()  # packing runs on the host (a no-op on the CPU)
        samples, token, value = {}, 0, 0
        for index, tokens in meta.tolist():
            size = layers * tokens * hidden
            stacked = states[value : value + size].view(layers, tokens, hidden)
            samples[index] = {
                "input_ids": ids[token : token + tokens],
                "loss_mask": masks[token : token + tokens],
                "hidden_states": list(stacked.unbind(0)),
            }
            token, value = token + tokens, value + size
        return StepSamples(samples=samples)

    def done(self, extraction_rank: int) -> None:
        self.request(extraction_rank, SampleRequest(DONE))

    # -- extraction side -----------------------------------------------------------------------
    def next_request(self) -> SampleRequest:
        """The next request from any training rank (blocks)."""
        box = torch.empty(4, dtype=torch.long)
        work = self.group.recv_anysource([box], _REQUEST_TAG)
        work.wait()
        kind, iteration, epoch, step = (int(value) for value in box)
        return SampleRequest(kind, iteration, epoch, step, source=int(work.source_rank()))

    def answer(self, training_rank: int, answer: StepSamples) -> None:
        if answer.failure is not None:
            message = torch.tensor(list(answer.failure.encode()[:4000]), dtype=torch.uint8)
            self._send(
                torch.tensor([_FAILED, message.numel(), 0, 0, 0], dtype=torch.long), training_rank
            )
            self._send(message, training_rank)
            return
        items = sorted(answer.samples.items())
        if not items:
            self._send(torch.tensor([_OK, 0, 0, 0, 0], dtype=torch.long), training_rank)
            return
        first = items[0][1]["hidden_states"]
        dtype, layers, hidden = first[0].dtype, len(first), int(first[0].shape[-1])
        if dtype not in _DTYPES:
            raise TypeError(
                f"hidden states of dtype {dtype} cannot be sent; expected one of {_DTYPES}"
            )
        meta = torch.tensor(
            [[index, int(sample["input_ids"].numel())] for index, sample in items], dtype=torch.long
        )
        self._send(
            torch.tensor([_OK, len(items), _DTYPES.index(dtype), layers, hidden], dtype=torch.long),
            training_rank,
        )
        self._send(meta.flatten(), training_rank)
        self._send(
            torch.cat(
                [torch.as_tensor(s["input_ids"], dtype=torch.long).flatten() for _, s in items]
            ),
            training_rank,
        )
        self._send(
            torch.cat(
                [torch.as_tensor(s["loss_mask"], dtype=torch.long).flatten() for _, s in items]
            ),
            training_rank,
        )
        states = torch.cat(
            [
                torch.stack([layer.to(dtype) for layer in s["hidden_states"]]).flatten()
                for _, s in items
            ]
        )
        self._send(states.to(self.payload_device), training_rank, self.payload_group)

    # -- both ----------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, rank: int, group: Any = None) -> None:
        tensor = tensor.contiguous()
        (group or self.group).send([tensor], rank, _ANSWER_TAG).wait()
        if tensor.is_cuda:  # NCCL's wait orders the stream; the bytes must have left before reuse
            torch.cuda.current_stream(tensor.device).synchronize()
        self.bytes_moved += tensor.numel() * tensor.element_size()

    def _recv(self, tensor: torch.Tensor, rank: int, group: Any = None) -> torch.Tensor:
        (group or self.group).recv([tensor], rank, _ANSWER_TAG).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        self.bytes_moved += tensor.numel() * tensor.element_size()
        return tensor
