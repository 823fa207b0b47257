"""Packed rows from the loader to the training device, typed as a step sees them.

The loaders yield `train.data`'s collate output: a `PackedBatch` dict, or `{"skipped_samples": n}`
alone for a row whose samples were all unusable. Inside the trainer a row is a `StepRow`: the
model inputs on the device and whether they hold samples. A row without samples becomes the
draft's one-token empty row, so the step (and on several ranks every collective) still happens
and the plan stays the same on every rank and on resume; it trains nothing and weighs 0.

On CUDA `prefetch_to_device` copies row n + 1 on a side stream while row n trains (the loader
pins its rows, so the copy is asynchronous); a row read from a reused host slot (`row_slots`)
records that copy, so that the slot is written again only once it is done. A row of fp8 states
(read from `--storage-dtype fp8` files: `train.stored_states.STATE_SCALES`) is dequantized here, on the
device, once copied: the host moves half the bytes. A row that carries its `row_noise` (the offline
loader's) is noised there, on the device, once copied: per sample, seeded by
`(seed, epoch, sample index)` (`noise_transforms.RowNoise`); on the CPU it is noised on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators_vllm016.train.data import MODEL_INPUTS
from speculators_vllm016.train.draft_contract import FusesVerifierStates
from speculators_vllm016.train.loading.row_slots import HOST_SLOT_KEY
from speculators_vllm016.train.stored_states import STATE_SCALES
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.fp8_storage import dequantize_fused

__all__ = ["StepRow", "empty_row", "prefetch_to_device", "to_step_row"]


@dataclass
class StepRow:
    """One packed row for one step: the model's inputs on the device (the empty row when the
    loader's row had no usable sample) and how many of its samples were dropped as unusable."""

    inputs: dict[str, torch.Tensor]
    has_samples: bool
    skipped_samples: torch.Tensor = field(default_factory=lambda: torch.zeros(()))


def empty_row(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """A one-token row with nothing to learn, for a step whose samples were all unusable."""
    if not isinstance(model, FusesVerifierStates):
        raise InvalidInputError("every sample of a packed row was unusable")
    zeros = torch.zeros(1, 1, dtype=torch.long, device=device)
    return {
        "input_ids": zeros,
        "hidden_states": torch.zeros(1, 1, model.fc.in_features, device=device),
        "verifier_last_hidden_states": torch.zeros(1, 1, model.target_hidden_size, device=device),
        "loss_mask": zeros,
        "position_ids": zeros + 1,
        "lengths": torch.ones(1, dtype=torch.long, device=device),
    }


def _skipped(batch: Mapping[str, Any]) -> torch.Tensor:
    return batch.get("skipped_samples", torch.zeros(()))


def _device_inputs(batch: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The row's model inputs on `device`, noised there when the row carries its `row_noise`."""
    inputs = {key: batch[key].to(device, non_blocking=True) for key in MODEL_INPUTS if key in batch}
    scales = {
        key: batch[scale].to(device, non_blocking=True)
        for key, scale in STATE_SCALES.items()
        if scale in batch
    }
    claim = batch.get(HOST_SLOT_KEY)
    if claim is not None:  # the loader reuses the row's host slot once this copy is done
        claim.record_copy()
    for key, scale in scales.items():  # fp8 states: back to the scale's dtype, here
        inputs[key] = dequantize_fused(inputs[key], scale, scale.dtype)
    noise = batch.get("row_noise")
    if noise is not None:
        if inputs["hidden_states"] is batch["hidden_states"]:  # already there: keep the row as read
            inputs = {
                key: value.clone() if "hidden_states" in key else value
                for key, value in inputs.items()
            }
        noise.apply(inputs, batch["lengths"].tolist(), batch["sample_indices"].tolist())
    return inputs


def to_step_row(
    batch: Mapping[str, Any] | StepRow, device: torch.device, model: torch.nn.Module
) -> StepRow:
    """The `StepRow` of a loader's row (its model inputs copied to `device` if not there yet)."""
    if isinstance(batch, StepRow):
        return batch
    if "input_ids" not in batch:
        return StepRow(empty_row(model, device), False, _skipped(batch))
    return StepRow(_device_inputs(batch, device), True, _skipped(batch))


def prefetch_to_device(
    batches: Iterable[Any], device: torch.device, model: torch.nn.Module
) -> Iterator[StepRow]:
    """`StepRow`s of the loader's rows; on CUDA each row's copy overlaps the previous step."""
    if device.type != "cuda":
        for batch in batches:
            yield to_step_row(batch, device, model)
        return
    stream = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)

    def send(batch: Any) -> tuple[Any, torch.cuda.Event | None]:
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            return batch, None
        stream.wait_stream(main)  # the row's memory may be reused from freed earlier rows
        with torch.cuda.stream(stream):
            inputs = _device_inputs(batch, device)
            ready = torch.cuda.Event()
            ready.record(stream)
        return StepRow(inputs, True, _skipped(batch)), ready

    def receive(sent: tuple[Any, torch.cuda.Event | None]) -> StepRow:
        row, ready = sent
        if ready is not None:
            main.wait_event(ready)
            for tensor in row.inputs.values():
                tensor.record_stream(main)
        return to_step_row(row, device, model)

    upcoming = None
    for batch in batches:
        current, upcoming = upcoming, send(batch)
        if current is not None:
            yield receive(current)
    if upcoming is not None:
        yield receive(upcoming)
