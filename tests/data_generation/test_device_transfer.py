"""RowWriter: rows land in their destinations (CPU path here; the CUDA path runs where CUDA is)."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.data_generation.device_transfer import RowTarget, RowWriter

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_reach_their_destinations(device):
    writer = RowWriter()
    destination = torch.zeros(3, 10, 8, dtype=torch.bfloat16)  # like a [layers, seq, hidden] file
    expected = torch.zeros_like(destination)
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        source = torch.randn(6, 8, generator=generator).to(torch.bfloat16)
        slot = step % 3
        targets = [RowTarget(destination[slot, 0:2], 0, 2), RowTarget(destination[slot, 5:9], 2, 4)]
        expected[slot, 0:2] = source[0:2]
        expected[slot, 5:9] = source[2:6]
        writer.write_rows(source.to(device), targets)
    writer.flush()
    assert torch.equal(destination, expected)
    writer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_nothing_to_write_is_fine_and_the_writer_stays_usable(device):
    writer = RowWriter()
    writer.write_rows(torch.ones(2, 2, device=device), [])
    writer.flush()
    destination = torch.zeros(1, 2)
    writer.write_rows(torch.arange(4.0).view(2, 2).to(device), [RowTarget(destination, 1, 1)])
    writer.flush()
    assert destination.tolist() == [[2.0, 3.0]]
    writer.close()
