"""The vllm engine's reading of vLLM's spec-decode counters, and when the CPU build can run it."""

from __future__ import annotations

import pytest
from vllm.v1.metrics.reader import Counter, Gauge, Vector

from speculators_vllm016.evaluate.runner import resolve_engine
from speculators_vllm016.evaluate.vllm_engine import (
    counts_difference,
    counts_from_metrics,
    speculative_decoding_unavailable,
)


def snapshot(drafts, draft_tokens, accepted, per_position):
    """What `LLM.get_metrics()` returns, for two engines (data parallel) splitting the work."""
    metrics = [Gauge(name="vllm:num_requests_running", labels={}, value=0.0)]
    for engine, share in (("0", 0.5), ("1", 0.5)):
        labels = {"engine": engine, "model_name": "m"}
        metrics += [
            Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=int(drafts * share)),
            Counter(
                name="vllm:spec_decode_num_draft_tokens",
                labels=labels,
                value=int(draft_tokens * share),
            ),
            Counter(
                name="vllm:spec_decode_num_accepted_tokens",
                labels=labels,
                value=int(accepted * share),
            ),
            Vector(
                name="vllm:spec_decode_num_accepted_tokens_per_pos",
                labels=labels,
                values=[int(v * share) for v in per_position],
            ),
        ]
    return metrics


def test_counters_are_summed_over_engines_and_differenced():
    before = counts_from_metrics(snapshot(20, 60, 10, [6, 4, 0]), 3)
    after = counts_from_metrics(snapshot(120, 360, 130, [80, 40, 10]), 3)
    assert (after.num_drafts, after.num_draft_tokens, after.num_accepted_tokens) == (120, 360, 130)
    run = counts_difference(after, before)
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (100, 300, 120)
    assert run.accepted_per_position == [74, 36, 10]
    assert run.acceptance_length == pytest.approx(2.2)
    assert run.per_position_rates == pytest.approx([0.74, 0.36, 0.10])


@pytest.fixture
def vllm_registry():
    """vLLM's Prometheus collectors registered by the test, removed before and after."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()


def test_counters_written_by_vllms_own_logger_are_read_back(vllm_registry):
    """vLLM's spec-decode Prometheus logger and its `get_metrics` reader (what `LLM.get_metrics`
    returns), fed per-step stats of two engines: the counts are the drafts observed."""
    from types import SimpleNamespace

    from vllm.v1.metrics.reader import get_metrics_snapshot
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    k = 3
    prom = SpecDecodingProm(
        SimpleNamespace(num_speculative_tokens=k),  # it reads only num_speculative_tokens
        labelnames=["model_name", "engine"],
        per_engine_labelvalues={0: ["m", "0"], 1: ["m", "1"]},
    )
    # Accepted tokens of each draft, per step, per engine.
    steps = {0: [[3, 0], [1, 2, 2]], 1: [[0], [3, 3, 1]]}
    before = counts_from_metrics(get_metrics_snapshot(), k)
    for engine, engine_steps in steps.items():
        for accepted_in_step in engine_steps:
            stats = SpecDecodingStats.new(k)
            for accepted in accepted_in_step:
                stats.observe_draft(num_draft_tokens=k, num_accepted_tokens=accepted)
            prom.observe(stats, engine_idx=engine)
    run = counts_difference(counts_from_metrics(get_metrics_snapshot(), k), before)
    drafts = [
        accepted for engine_steps in steps.values() for step in engine_steps for accepted in step
    ]
    assert run.num_drafts == len(drafts) == 9
    assert run.num_draft_tokens == k * len(drafts)
    assert run.num_accepted_tokens == sum(drafts) == 15
    assert run.accepted_per_position == [sum(a > p for a in drafts) for p in range(k)] == [7, 5, 3]
    assert run.acceptance_length == pytest.approx(1 + 15 / 9)


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@pytest.mark.skipif(not _cpu_build(), reason="checks vLLM's CPU build")
def test_the_cpu_build_speculates_through_the_plugin_and_auto_stays_hf(monkeypatch):
    monkeypatch.delenv("SPECULATORS_VLLM_PLUGIN", raising=False)
    monkeypatch.delenv("SPECULATORS_CPU_SPECULATION", raising=False)
    assert speculative_decoding_unavailable() is None
    assert resolve_engine("vllm") == "vllm"
    assert resolve_engine("auto") == "hf"  # interpreted kernels: vllm is for checking, not speed
    for switch, named in (
        ("SPECULATORS_CPU_SPECULATION", "CPU speculation is switched off"),
        ("SPECULATORS_VLLM_PLUGIN", "plugin, which lifts that, is switched off"),
    ):
        monkeypatch.setenv(switch, "0")
        with pytest.raises(ValueError, match=f"{named}.*; use --engine hf"):
            resolve_engine("vllm")
        assert resolve_engine("auto") == "hf"
        monkeypatch.delenv(switch)
    with pytest.raises(ValueError, match="unknown engine"):
        resolve_engine("tgi")


def test_each_prompt_set_gets_its_own_counters_on_one_engine(monkeypatch):
    """`--context-lengths` on the vllm engine: one engine per draft, each prompt set's counts read
    before and after its own generation (vLLM's counters are cumulative). The engine is a
    stand-in (no GPU build here) that adds 10 drafts per prompt and accepts one more per set."""
    import vllm

    from speculators_vllm016.evaluate import vllm_engine

    started = []

    class Output:
        def __init__(self, ids):
            self.outputs = [type("Completion", (), {"token_ids": ids})()]

    class StandIn:
        def __init__(self, **kwargs):
            started.append(kwargs)
            self.totals = [0, 0, 0, [0, 0, 0]]
            self.sets = 0

        def get_metrics(self):
            drafts, tokens, accepted, per_position = self.totals
            return snapshot(drafts, tokens, accepted, per_position)

        def generate(self, requests, params, use_tqdm=False):
            self.sets += 1
            drafts = 10 * len(requests)
            self.totals[0] += drafts
            self.totals[1] += 3 * drafts
            self.totals[2] += self.sets * drafts
            self.totals[3] = [v + drafts * (k < self.sets) for k, v in enumerate(self.totals[3])]
            return [Output([7] * params.max_tokens) for _ in requests]

    monkeypatch.setattr(vllm_engine, "speculative_decoding_unavailable", lambda: None)
    monkeypatch.setattr(vllm_engine, "on_cpu_build", lambda: False)  # no CPU environment to set
    monkeypatch.setattr(vllm, "LLM", StandIn)
    results = vllm_engine.evaluate_prompt_sets_with_vllm(
        "draft", "verifier", [[[1, 2]], [[1, 2, 3], [4]], [[5]]], 2, 3
    )
    assert len(started) == 1
    assert [r.counts.num_drafts for r in results] == [10, 20, 10]
    assert [r.counts.acceptance_length for r in results] == [2.0, 3.0, 4.0]
    assert [r.counts.accepted_per_position for r in results] == [
        [10, 0, 0],
        [20, 20, 0],
        [10, 10, 10],
    ]
    assert [len(r.outputs) for r in results] == [1, 2, 1]
