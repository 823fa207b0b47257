"""The demo's serve stage, its pure logic (`demo.serving`): each draft's tau on the short and the
long prompts from vLLM's counters, their ratio, the outputs compared with plain greedy on the
matching set, the long prompts' mean length, and the summary lines that print them per draft.
The stage itself (vLLM's engines) is tested by the demo's end-to-end test (tests/demo/test_cli.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculators_vllm016.demo.serving import (
    _draft_figures,
    _long_prompt_figures,
    serving_lines,
)


def _generated(tau: float, rates: list[float], outputs: list[list[int]], speed: float = 5.0):
    """What `generate_sets_with_vllm` returns per prompt set, as far as the stage reads it."""
    counts = SimpleNamespace(acceptance_length=tau, per_position_rates=rates)
    return SimpleNamespace(counts=counts, outputs=outputs, tokens_per_second=speed)


# Plain greedy on the short and the long prompts (three prompts each).
PLAIN = [
    _generated(1.0, [], [[1, 2], [3, 4], [5, 6]], 9.0),
    _generated(1.0, [], [[7, 8], [9, 10], [11, 12]], 8.0),
]


def _served(short_tau: float, long_tau: float):
    short = _generated(short_tau, [0.9, 0.6], [[1, 2], [3, 4], [5, 0]], 4.0)  # 2 of 3 equal
    long = _generated(long_tau, [0.5, 0.2], [[7, 8], [9, 10], [11, 12]], 3.0)  # 3 of 3 equal
    return [short, long]


def test_each_set_is_counted_from_its_own_counters_and_compared_with_its_own_plain_outputs():
    figures = _draft_figures("shipped", _served(3.2, 2.4), PLAIN)
    assert figures == {
        "vllm_tau_shipped": 3.2,
        "vllm_rates_shipped": [0.9, 0.6],
        "tokens_per_second_shipped": 4.0,
        "lossless_shipped": 2,
        "vllm_tau_long_shipped": 2.4,
        "vllm_rates_long_shipped": [0.5, 0.2],
        "lossless_long_shipped": 3,
        "long_over_short_shipped": pytest.approx(2.4 / 3.2),
    }


def test_without_long_prompts_no_long_figure_is_made():
    figures = _draft_figures("shipped", _served(3.2, 2.4)[:1], PLAIN[:1])
    assert not [name for name in figures if "long" in name]


def test_the_long_prompts_length_is_their_mean_as_built():
    assert _long_prompt_figures(600, [[1] * 400, [1] * 500, [1] * 600]) == {
        "long_context": 600,
        "long_prompt_tokens": 500.0,
    }


def test_the_summary_prints_each_drafts_own_figures():
    """Two drafts with different figures: a line that reads another draft's (or the short
    prompts') value fails."""
    figures = {
        "prompts": 3,
        "plain_tokens_per_second": 9.0,
        "eval_tau": {"shipped": 3.2, "regenerated": 3.6},
        **_long_prompt_figures(600, [[1] * 450, [1] * 550]),
        **_draft_figures("shipped", _served(3.2, 1.6), PLAIN),
        **_draft_figures("regenerated", _served(3.6, 2.7), PLAIN),
    }
    lines = serving_lines(figures)
    assert lines[1].startswith("  shipped: tau 3.2000 by vLLM's counters (eval: 3.2000)")
    assert "outputs equal to plain greedy on 2/3" in lines[1]
    assert lines[2] == (
        "    at ~500-token prompts (--long-context 600): tau 1.6000, long/short 0.50; outputs "
        "equal to plain greedy on 3/3"
    )
    assert lines[3].startswith("  regenerated: tau 3.6000 by vLLM's counters (eval: 3.6000)")
    assert "tau 2.7000, long/short 0.75;" in lines[4]
    assert lines[5] == "  without speculation: 9.0 tokens/s"
