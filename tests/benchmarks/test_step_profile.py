"""The step profile's split of a step's time by op class (its GPU runs happen on the lent
machines; the attribution is the same on a CPU, over the ops' own CPU time)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.step_profile import _PREFIX, attribute_device_time, attribute_idle


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


def test_idle_gaps_go_to_the_code_that_launched_the_work_ending_them() -> None:
    """Two steps' trace: kernels at 0-10 and 30-40 us (a 20 us gap, launched from `pack_row`
    inside `forward`), a copy within the second (no gap of its own), and at 100-110 us a kernel whose
    launch nothing of ours framed (charged to its op); one host wait of 50 us."""
    frame = "speculators_vllm016/models/eagle3/{}"
    events = [
        {"cat": "kernel", "ts": 0, "dur": 10, "args": {"correlation": 1}},
        {"cat": "kernel", "ts": 30, "dur": 10, "args": {"correlation": 2}},
        {"cat": "gpu_memcpy", "ts": 32, "dur": 6, "args": {"correlation": 3}},
        {"cat": "kernel", "ts": 100, "dur": 10, "args": {"correlation": 4}},
        {
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "tid": 7,
            "ts": 25,
            "dur": 2,
            "args": {"correlation": 2},
        },
        {
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "tid": 9,
            "ts": 90,
            "dur": 2,
            "args": {"correlation": 4},
        },
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "tid": 7, "ts": 60, "dur": 50},
        {
            "cat": "python_function",
            "name": frame.format("core.py(1): forward"),
            "tid": 7,
            "ts": 0,
            "dur": 120,
        },
        {
            "cat": "python_function",
            "name": frame.format("packed_row.py(5): pack_row"),
            "tid": 7,
            "ts": 20,
            "dur": 10,
        },
        {
            "cat": "python_function",
            "name": "torch/nn/modules/module.py(9): _call_impl",
            "tid": 7,
            "ts": 24,
            "dur": 4,
        },
        {
            "cat": "cpu_op",
            "name": "autograd::engine::evaluate_function: MmBackward0",
            "tid": 9,
            "ts": 80,
            "dur": 20,
        },
        {"cat": "cpu_op", "name": "aten::mm", "tid": 9, "ts": 85, "dur": 10},
    ]
    idle = attribute_idle(events, steps=2)
    assert idle["device_span_ms_per_step"] == 0.055  # 0 to 110 us over 2 steps
    assert idle["idle_ms_per_step"] == 0.04  # (20 + 60) us over 2 steps
    assert idle["idle_by_launch_site_ms_per_step"] == [
        ["autograd::engine::evaluate_function: MmBackward0", 0.03],
        ["models/eagle3/packed_row.py(5): pack_row", 0.01],
    ]
    assert idle["host_waits_ms"] == [[0.05, "models/eagle3/core.py(1): forward"]]
    assert attribute_idle([], steps=1) == {}
