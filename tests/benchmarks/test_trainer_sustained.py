"""The trainer benchmark's several-epoch figures, from a metrics log the trainer would write."""

from __future__ import annotations

import json

from benchmarks.trainer_gpu import make_parser, summarize_epochs


def test_per_epoch_rates_waits_and_first_steps(tmp_path) -> None:
    lines = []
    step = 0
    for epoch, seconds in ((0, [30.0, 0.1, 0.1]), (1, [2.0, 0.1, 0.1])):
        for position, spent in enumerate(seconds):
            wait = spent - 0.1 if step else 0.01  # the first step compiles, it does not wait
            lines.append({"step": step, "epoch": epoch, "lr": 1e-3, "train": {
                "tokens": 8000.0, "step_seconds": spent, "data_wait_seconds": wait, "loss": 1.0}})
            step += 1
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = summarize_epochs(path)
    first, second = summary["epochs"]
    assert first == {"epoch": 0, "steps": 3, "tokens_per_second": 80000.0,
                     "max_data_wait_seconds": 0.0, "first_step_seconds": 30.0}
    assert second["tokens_per_second"] == round(24000 / 2.2, 1)
    assert second["max_data_wait_seconds"] == 1.9 and second["first_step_seconds"] == 2.0
    assert summary["median_step_tokens_per_second"] == 80000.0


def test_the_sustained_mode_is_one_flag() -> None:
    args = make_parser().parse_args(["--runs", "single", "--sustained"])
    assert args.sustained and args.steps_per_epoch == 40 and args.epochs is None
