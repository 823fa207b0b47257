"""The step profile's split of a step's time by op class (its GPU runs happen on the lent
machines; the attribution is the same on a CPU, over the ops' own CPU time)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.step_profile import _PREFIX, attribute_device_time


def test_backward_ops_go_to_the_region_of_their_forward_op() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(384, 384, generator=generator)
    w = torch.randn(384, 384, generator=generator, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(_PREFIX + "draft layer"):
            y = x @ w @ w
        with record_function(_PREFIX + "fused loss"):
            loss = y.tanh().mean()
        loss.backward()  # in no region: its matrix products belong to the draft layer
    split = attribute_device_time(prof.events(), cuda=False)
    assert split["draft layer"] > 0 and split["fused loss"] > 0
    # Four backward products against two forward ones: were they left in `other`, it would
    # hold about twice the draft layer's time.
    assert split["other"] < 0.5 * split["draft layer"]
    parts = sum(value for key, value in split.items() if key not in ("total", "copies"))
    assert abs(parts - split["total"]) < 0.01
