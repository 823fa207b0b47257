"""The benchmark's schedule and engine settings, as benchmarks/README.md states them.

The three paths are replaced by recorders (what is checked is the order of calls, which is pure
logic); the engine-settings test stops each engine's constructor before anything starts.
"""

from __future__ import annotations

import os

import pytest

import benchmarks.extraction as extraction
import benchmarks.paths as paths
from benchmarks.paths import Measurement
from benchmarks.presets import build_settings


class Recorder:
    def __init__(self, key: str, events: list) -> None:
        self.key, self.events = key, events

    def start(self, warmup):
        self.events.append(("start", self.key, len(warmup)))

    def prime(self, sequence):
        self.events.append(("prime", self.key))

    def run(self, sequences, repeat):
        self.events.append(("run", self.key, repeat))
        return Measurement(self.key, repeat, sum(map(len, sequences)), 1.0)

    def close(self):
        self.events.append(("close", self.key))


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    events: list = []
    monkeypatch.setattr(paths, "make_path", lambda key, *args: Recorder(key, events))
    monkeypatch.setattr(extraction.time, "sleep", lambda seconds: events.append(("sleep", seconds)))
    return events


SEQUENCES = [[1, 2, 3]] * 6


def test_interleaved_runs_alternate_after_every_engine_is_up(recorded, tmp_path):
    settings = build_settings("smoke", repeats=4, schedule="interleaved", output_dir=str(tmp_path))
    measurements, starts = extraction._measure(settings, "model", SEQUENCES)
    runs = [(event[1], event[2]) for event in recorded if event[0] == "run"]
    a, b, c = "extraction", "vllm_prefill", "hf_forward"
    assert runs == [
        (a, 0),
        (b, 0),
        (c, 0),
        (b, 1),
        (a, 1),
        (c, 1),
        (a, 2),
        (b, 2),
        (c, 2),
        (b, 3),
        (a, 3),
        (c, 3),
    ]
    first_run = next(i for i, event in enumerate(recorded) if event[0] == "run")
    # Start-up and warm-up (on the first sequences) happen before any timed run.
    assert [event for event in recorded[:first_run] if event[0] == "start"] == [
        ("start", key, 4) for key in (a, b, c)
    ]
    # Each run is preceded by a settle pause and a priming request to that same engine.
    for index, event in enumerate(recorded):
        if event[0] == "run":
            assert recorded[index - 1] == ("prime", event[1])
            assert recorded[index - 2][0] == "sleep" and recorded[index - 2][1] >= 3.0
    # Only the runs are measured.
    assert [(m.path, m.repeat) for m in measurements] == runs
    assert set(starts) == {a, b, c}


def test_grouped_runs_one_engine_at_a_time(recorded, tmp_path):
    settings = build_settings("smoke", repeats=2, schedule="grouped", output_dir=str(tmp_path))
    extraction._measure(settings, "model", SEQUENCES)
    order = [event[:2] for event in recorded]
    expected = []
    for key in ("extraction", "vllm_prefill", "hf_forward"):
        expected += [("start", key), ("run", key), ("run", key), ("close", key)]
    assert order == expected


class Stop(Exception):
    pass


def test_extraction_and_vllm_prefill_get_the_same_engine_settings(
    monkeypatch, tmp_path, tiny_llama
):
    import vllm

    from speculators_vllm016.data_generation import vllm_hidden_states_generator as module

    seen = {}

    def generator(model, **kwargs):
        seen["a"] = kwargs
        raise Stop

    def llm(**kwargs):
        seen["b"] = kwargs
        raise Stop

    monkeypatch.setattr(module, "VllmHiddenStatesGenerator", generator)
    monkeypatch.setattr(vllm, "LLM", llm)
    settings = build_settings("cpu-small", output_dir=str(tmp_path))
    saved = dict(os.environ)
    try:
        for key in ("extraction", "vllm_prefill"):
            with pytest.raises(Stop):
                paths.make_path(key, settings, str(tiny_llama), tmp_path).start([[1]])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    shared = (
        "dtype",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "gpu_memory_utilization",
    )
    assert {k: seen["a"][k] for k in shared} == {k: seen["b"][k] for k in shared}
    # What the generator always runs with (eager, chunked prefill, no prefix caching by default).
    assert seen["b"]["enforce_eager"] is True and seen["b"]["enable_chunked_prefill"] is True
    assert seen["b"]["enable_prefix_caching"] is False
    assert seen["a"].get("enable_prefix_caching", False) is False
