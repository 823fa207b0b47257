"""The trainer benchmark's several-epoch figures, from a metrics log the trainer would write."""

from __future__ import annotations

import json
import os
import time

from benchmarks.trainer_gpu import make_parser, summarize_epochs, write_samples
from benchmarks.trainer_processes import checkpoint_pruning
from benchmarks.training import PRESETS


def test_per_epoch_rates_waits_and_first_steps(tmp_path) -> None:
    lines = []
    step = 0
    for epoch, seconds in ((0, [30.0, 0.1, 0.1]), (1, [2.0, 0.1, 0.1])):
        for _position, spent in enumerate(seconds):
            wait = spent - 0.1 if step else 0.01  # the first step compiles, it does not wait
            lines.append(
                {
                    "step": step,
                    "epoch": epoch,
                    "lr": 1e-3,
                    "train": {
                        "tokens": 8000.0,
                        "step_seconds": spent,
                        "data_wait_seconds": wait,
                        "loss": 1.0,
                    },
                }
            )
            step += 1
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = summarize_epochs(path)
    first, second = summary["epochs"]
    slowest = first.pop("slowest_steps")
    assert [entry["step"] for entry in slowest] == [1, 2]  # the compiling first step is not timed
    assert second["slowest_steps"][0] == {"step": 3, "seconds": 2.0, "data_wait_seconds": 1.9}
    assert first == {
        "epoch": 0,
        "steps": 3,
        "tokens_per_second": 80000.0,
        "max_data_wait_seconds": 0.0,
        "steps_waiting_over_0.2_s": 0,
        "total_data_wait_seconds": 0.0,
        "first_step_seconds": 30.0,
        "median_step_seconds": 0.1,  # the timed steps only (the first compiles)
        "last_step_seconds": 0.1,
        "last_step_tokens": 8000.0,
    }
    assert second["tokens_per_second"] == round(24000 / 2.2, 1)
    assert second["max_data_wait_seconds"] == 1.9 and second["first_step_seconds"] == 2.0
    assert second["steps_waiting_over_0.2_s"] == 1
    assert second["last_step_seconds"] == 0.1 and second["median_step_seconds"] == 0.1
    assert summary["median_step_tokens_per_second"] == 80000.0


def test_the_sustained_mode_is_one_flag() -> None:
    args = make_parser().parse_args(["--runs", "single", "--sustained"])
    assert args.sustained and args.steps_per_epoch == 40 and args.epochs is None


def test_samples_beyond_the_unique_count_are_hard_links(tmp_path) -> None:
    from dataclasses import replace

    preset = replace(PRESETS["llama-3.1-8b-draft"], hidden_size=8)
    folder = write_samples(preset, tmp_path / "data", count=5, tokens=16, unique=2)
    files = sorted(folder.glob("data_*.pt"))
    assert len(files) == 5
    assert (folder / "data_4.pt").stat().st_ino == (folder / "data_0.pt").stat().st_ino
    assert (folder / "data_1.pt").stat().st_ino != (folder / "data_0.pt").stat().st_ino


def test_pruning_keeps_the_newest_finished_checkpoints(tmp_path) -> None:
    for index, name in enumerate(["0", "1", "2", "best"]):
        folder = tmp_path / name
        folder.mkdir()
        if name != "best":
            (folder / "model.safetensors").write_text("x")
            stamp = time.time() - 100 + index
            os.utime(folder, (stamp, stamp))
    with checkpoint_pruning(tmp_path, 1):
        deadline = time.time() + 10
        while (tmp_path / "0").exists() and time.time() < deadline:
            time.sleep(0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "best"]


def test_the_row_slot_ab_run_is_one_process_without_row_slots(tmp_path) -> None:
    from benchmarks.trainer_gpu import SINGLE_NO_ROW_SLOTS, train_command

    args = make_parser().parse_args(["--runs", "single", SINGLE_NO_ROW_SLOTS, "--sustained"])
    args.epochs = 3
    paths = {name: tmp_path / name for name in ("verifier", "data", "d2t", "t2d")}
    plain = train_command("single", 1, paths, tmp_path / "a", args)
    ab = train_command(SINGLE_NO_ROW_SLOTS, 1, paths, tmp_path / "b", args)
    assert "--no-row-slots" in ab and "--no-row-slots" not in plain
    assert ab[1:3] == plain[1:3] == ["-m", "speculators_vllm016"]  # no torchrun
