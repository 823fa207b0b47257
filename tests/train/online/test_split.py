"""`speculators train --online --extraction-ranks K` under torchrun on the real engine (CPU, gloo):
extraction ranks apart from training ranks, equal to offline training with as many training ranks,
bit for bit (fp32), with and without --cache-dir; an engine worker killed on an extraction rank
leaves a checkpoint and exit 143 on every training rank, and the same command resumes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from speculators_vllm016.cli.train import main as train_main
from tests.train.online.test_loader import (
    assert_same_weights,
    common,
    kill_engine_workers_after_first_step,
    online_flags,
)
from tests.training_fixtures import cli_env, train_command

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def split_argv(
    tiny_llama: Path, root: Path, chats: Path, save: Path, ranks: int, *extra: str
) -> list[str]:
    return [
        *common(tiny_llama, root, save),
        "--parallel",
        "ddp",
        *online_flags(chats, root),
        "--extraction-ranks",
        str(ranks),
        *extra,
    ]


def run(argv: list[str], processes: int, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(argv, processes=processes),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_two_extraction_ranks_train_exactly_as_offline_with_two_training_ranks(
    setup, tiny_llama, offline_two
):
    """One extraction rank beside two training ranks is the killed test's run below (every step
    of it extracted by one rank, before or after the kill, ending at offline's weights) and the
    Kimi-K2.5 recipe's (tests/test_kimi_k25_recipe.py, one training rank): not run again here."""
    root, chats, datagen = setup
    two, cache = root / "split-2-2-hybrid", root / "split-cache"
    done = run(split_argv(tiny_llama, root, chats, two, 2, "--cache-dir", str(cache)), 4)
    assert done.returncode == 0, done.stderr[-4000:]
    for epoch in ("0", "1"):
        assert_same_weights(two / epoch, offline_two / epoch)
    # The training ranks' own metrics log, with the bytes they received.
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    moved = [r["train"]["online_bytes"] for r in records if "train" in r]
    assert moved and moved[-1] > 0 and moved == sorted(moved)
    # Both extraction ranks wrote their shard of one datagen folder: datagen's files, byte for byte.
    names = sorted(path.name for path in cache.glob("data_*.pt"))
    assert names == sorted(path.name for path in datagen.glob("data_*.pt"))
    assert sorted(path.name for path in (cache / "manifest").iterdir()) == [
        "shard-0-of-2.jsonl",
        "shard-1-of-2.jsonl",
    ]
    for name in names:
        assert (cache / name).read_bytes() == (datagen / name).read_bytes(), name


def test_an_extraction_ranks_engine_worker_killed_stops_every_training_rank_with_a_checkpoint(
    setup, tiny_llama, offline_two
):
    root, chats, _ = setup
    save = root / "split-killed"
    argv = split_argv(tiny_llama, root, chats, save, 1, "--online-queue-size", "1")
    # stderr carries both the ranks' messages and torchrun's failure summary
    process = subprocess.Popen(
        train_command(argv, processes=3),
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    output = kill_engine_workers_after_first_step(process, save)
    assert process.returncode != 0, output[-3000:]
    stopped = re.findall(
        r"^stopped: extraction rank 0: the target model's engine failed: a worker process died",
        output,
        flags=re.MULTILINE,
    )
    assert len(stopped) >= 2, output[-4000:]  # each training rank says it, naming the rank
    exits = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", output))
    assert exits.get("1") == "143" and exits.get("2") == "143", output[-3000:]
    assert not (save / "1").exists()
    assert list(save.glob("*-step*/training_state.json"))
    finished = run(argv, 3)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same_weights(save / "1", offline_two / "1")


def test_bad_layouts_stop_before_any_engine_with_one_line(setup, tiny_llama, capsys):
    root, chats, _ = setup
    save = root / "split-bad"
    done = run(split_argv(tiny_llama, root, chats, save, 2), 2, timeout=600)
    assert done.returncode != 0
    assert (
        "error: --extraction-ranks 2 leaves no training rank among torchrun's 2 processes"
        in done.stderr
    )
    assert "starting the target model's engine" not in done.stderr + done.stdout
    # Without torchrun, and without --online: one line each, exit 2.
    assert train_main(split_argv(tiny_llama, root, chats, save, 1)) == 2
    assert "--extraction-ranks needs torchrun" in capsys.readouterr().err
    plain = [*common(tiny_llama, root, save), "--data-path", str(root), "--extraction-ranks", "1"]
    assert train_main(plain) == 2
    assert "add --online" in capsys.readouterr().err
