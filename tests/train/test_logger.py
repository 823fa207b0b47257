"""Console logging of `speculators train` when the command runs in-process."""

from __future__ import annotations

import io
import logging
import sys

from speculators_vllm016.train.logger import setup_root_logger


def test_console_logging_follows_stderr_after_the_caller_swapped_it(monkeypatch) -> None:
    """A caller (a test's capture, a notebook) set sys.stderr, ran `train`, then closed its
    stream: later records go to the current stderr instead of a 'Logging error' traceback."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    try:
        setup_root_logger("INFO")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("speculators_vllm016.test").info("after the swap")
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])
    assert "after the swap" in second.getvalue() and "Logging error" not in second.getvalue()


def test_per_step_metrics_stay_off_the_console_while_the_progress_bar_shows_them(
    tiny_llama, training_data, tmp_path, capsys
):
    """#37 item 22: a line per step broke the bar. With the bar, the console gets no per-step
    record (the bar shows loss, acc, tokens/s) and metrics.jsonl every one; with --no-progress
    the per-step lines come back (a batch job's log has no bar)."""
    import json

    from speculators_vllm016.cli.train import main
    from tests.training_fixtures import train_args

    for progress in (True, False):
        save = tmp_path / f"progress-{progress}"
        argv = train_args(tiny_llama, training_data, save, "--epochs", "1")
        if progress:
            argv.remove("--no-progress")
        assert main(argv) == 0
        err = capsys.readouterr().err
        lines = (save / "metrics.jsonl").read_text().splitlines()
        steps = sum("train" in json.loads(line) for line in lines)
        assert steps > 1
        printed = [line for line in err.splitlines() if "train/loss=" in line]
        if progress:
            assert printed == [] and "tok_s=" in err and "acc=" in err, err[-2000:]
        else:
            assert len(printed) == steps
