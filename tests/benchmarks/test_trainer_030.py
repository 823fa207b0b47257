"""0.3.0's trainer beside ours: its command line, its rows, and reading its step times."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks.trainer_030 import (
    NAME,
    command_030,
    find_train_script,
    markdown_lines,
    packing_030,
    parse_console,
    read_records,
    summarize_030,
)
from benchmarks.trainer_gpu import make_parser, write_markdown

PATHS = {
    "verifier": Path("/w/verifier"),
    "data": Path("/w/data"),
    "d2t": Path("/w/d2t.npy"),
    "t2d": Path("/w/t2d.npy"),
}
# Every flag of v0.3.0's scripts/train.py (its parse_args).
FLAGS_030 = {
    "--verifier-name-or-path",
    "--data-path",
    "--save-path",
    "--epochs",
    "--lr",
    "--no-resume-from-checkpoint",
    "--logger",
    "--total-seq-len",
    "--data-format-version",
    "--log-dir",
    "--run-name",
    "--num-layers",
    "--d2t-path",
    "--t2d-path",
    "--ttt-steps",
    "--ttt-step-loss-decay",
}


def _flag_values(command: list[str], start: int) -> dict[str, str | None]:
    values: dict[str, str | None] = {}
    rest = command[start:]
    for index, word in enumerate(rest):
        if word.startswith("--"):
            following = rest[index + 1] if index + 1 < len(rest) else None
            values[word] = None if following is None or following.startswith("--") else following
    return values


def test_the_command_runs_train_py_under_torchrun_through_the_launcher(tmp_path) -> None:
    save = tmp_path / "run-030" / "checkpoints"
    command = command_030(
        Path("/w/train.py"), PATHS, save, 8192, 3, records=tmp_path / "r.jsonl", python="python3"
    )
    assert command[:6] == [
        "python3",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
    ]
    assert command[6].endswith("benchmarks/trainer_030.py")
    assert command[7:10] == ["--records", str(tmp_path / "r.jsonl"), "/w/train.py"]
    flags = _flag_values(command, 10)
    assert set(flags) <= FLAGS_030
    assert flags == {
        "--verifier-name-or-path": "/w/verifier",
        "--data-path": "/w/data",
        "--save-path": str(save),
        "--log-dir": str(save.parent / "logs"),
        "--d2t-path": "/w/d2t.npy",
        "--t2d-path": "/w/t2d.npy",
        "--total-seq-len": "8192",
        "--epochs": "3",
        "--data-format-version": "1",
        "--no-resume-from-checkpoint": None,
    }
    plain = command_030(Path("/w/train.py"), PATHS, save, 4096, 1, lr=3e-4, python="python3")
    assert plain[6] == "/w/train.py"
    assert _flag_values(plain, 7)["--lr"] == "0.0003"


def test_the_script_is_found_in_its_folder(tmp_path, monkeypatch) -> None:
    assert find_train_script(tmp_path) is None
    (tmp_path / "speculators030_train.py").write_text("")
    expected = (tmp_path / "speculators030_train.py").resolve()
    assert find_train_script(tmp_path) == expected
    assert find_train_script(tmp_path / "speculators030_train.py") == expected
    monkeypatch.chdir(tmp_path)  # `--with-030 .whl`: absolute, as the run starts elsewhere
    assert find_train_script(".") == expected


def test_rows_follow_0_3_0s_split_shift_and_packing() -> None:
    # 144 files of 2048 tokens: 129 train (90%), 2047 tokens each after the shift, 4 per row.
    assert packing_030(8192, 2048, 144) == {
        "samples_per_row": 4,
        "tokens_per_step": 8188,
        "train_files": 129,
        "epoch_tokens": 129 * 2047,
        "steps_per_epoch": 33,
    }
    assert packing_030(1024, 4096, 10)["tokens_per_step"] == 1024  # one truncated sample a row


def _records() -> list[dict]:
    def step(moment: float, epoch: int, loss: float) -> dict:
        return {
            "time": moment,
            "logger": "speculators.metrics",
            "message": {"train": {"loss_0": loss, "loss": loss}, "epoch": epoch, "lr": 1e-4},
        }

    def said(moment: float, text: str) -> dict:
        return {"time": moment, "logger": "speculators", "message": text}

    return [
        said(100.0, "No previous checkpoint found. Starting from scratch."),
        said(100.0, "Training epoch 1/2 started"),
        step(130.0, 0, 3.0),  # compiles: left out of the rates
        step(130.5, 0, 2.9),
        step(131.0, 0, 2.8),
        step(131.25, 0, 2.7),  # last: half a row
        said(131.3, "Training epoch 1/2 completed"),
        said(131.3, "Validation epoch 1/2 started"),
        {
            "time": 131.8,
            "logger": "speculators.metrics",
            "message": {"val": {"loss_epoch": 2.0}, "epoch": 0},
        },
        said(131.9, "Validation epoch 1/2 completed"),
        said(132.0, "Started saving checkpoint to /w/run-030/checkpoints/0"),
        said(142.0, "Finished saving checkpoint to /w/run-030/checkpoints/0"),
        said(142.0, "Training epoch 2/2 started"),
        step(
            144.0, 1, 2.6
        ),  # the epoch's first step: from the epoch's start, data loading included
        step(145.0, 1, 2.5),
        step(146.0, 1, 2.4),
        step(146.5, 1, 2.3),
        said(146.6, "Training epoch 2/2 completed"),
        said(147.0, "Started saving checkpoint to /w/run-030/checkpoints/1"),
        said(154.5, "Finished saving checkpoint to /w/run-030/checkpoints/1"),
    ]


def test_step_intervals_give_per_epoch_and_median_rates() -> None:
    summary = summarize_030(_records(), tokens_per_step=1000, epoch_tokens=3500)
    first, second = summary["epochs"]
    assert first == {
        "epoch": 0,
        "steps": 4,
        "tokens_per_second": 2000.0,  # 2500 tokens / 1.25 s
        "max_data_wait_seconds": None,
        "first_step_seconds": 30.0,
        "seconds": 31.25,
        "validation_seconds": 0.6,
    }
    # 3500 tokens over 4.5 s: the first step of a later epoch counts, from the epoch's start.
    assert second["tokens_per_second"] == round(3500 / 4.5, 1)
    assert second["first_step_seconds"] == 2.0 and second["validation_seconds"] is None
    # per step: 2000, 2000, 2000 (epoch 0), 500, 1000, 1000, 1000 (epoch 1)
    assert summary["median_step_tokens_per_second"] == summary["median_tokens_per_second"] == 1000.0
    assert summary["min_tokens_per_second"] == 500.0 and summary["max_tokens_per_second"] == 2000.0
    assert summary["steps_logged"] == 8 and summary["timed_steps"] == 7
    assert summary["aggregate_tokens_per_second"] == round(6000 / 5.75, 1)
    assert summary["checkpoint_save_seconds_each"] == [10.0, 7.5]
    assert summary["checkpoint_save_seconds"] == 7.5 and summary["final_loss"] == 2.3


def test_without_a_row_count_every_step_is_a_full_row() -> None:
    summary = summarize_030(_records(), tokens_per_step=1000)
    assert summary["epochs"][0]["tokens_per_second"] == 2400.0  # 3000 tokens / 1.25 s


# 0.3.0's console (rich, `[%X]` times; a repeated time is left blank; long messages wrap).
CONSOLE = textwrap.dedent("""\
    [23:59:58] INFO     No previous checkpoint found. Starting from scratch.                 trainer.py:84
               INFO     Training epoch 1/2 started                                          trainer.py:241
    Epoch 0   0%                                              0/3  [ 0:00:30 < -:--:-- , ? it/s ]
    [23:59:59] INFO     train/loss_0=0.102, train/full_acc_0=0.00e+00, train/cond_acc_0=0.00e+00, trainer.py:190
                        train/loss=0.308, epoch=0, lr=1.00e-04
    [00:00:01] INFO     train/loss_0=0.101, train/full_acc_0=0.00e+00, train/cond_acc_0=0.00e+00, trainer.py:190
                        train/loss=0.304, epoch=0, lr=9.00e-05
    [00:00:03] INFO     train/loss_0=0.100, train/full_acc_0=0.00e+00, train/cond_acc_0=0.00e+00, trainer.py:190
                        train/loss=0.301, epoch=0, lr=8.00e-05
               INFO     Training epoch 1/2 completed                                        trainer.py:243
               INFO     Validation epoch 1/2 started                                        trainer.py:251
    [00:00:04] INFO     val/loss_0_epoch=0.098, val/full_acc_0_epoch=0.00e+00, epoch=0      trainer.py:229
               INFO     Validation epoch 1/2 completed                                      trainer.py:253
               INFO     Started saving checkpoint to /w/run-030/checkpoints/0               trainer.py:258
    [00:00:09] INFO     Finished saving checkpoint to /w/run-030/checkpoints/0              trainer.py:262
               INFO     Training epoch 2/2 started                                          trainer.py:241
    [00:00:11] INFO     train/loss_0=0.098, train/full_acc_0=0.002, train/cond_acc_0=0.002,   trainer.py:190
                        train/loss=0.293, epoch=1, lr=5.00e-05
    [00:00:12] INFO     train/loss_0=0.098, train/full_acc_0=0.00e+00, train/cond_acc_0=0.00e+00, trainer.py:190
                        train/loss=0.290, epoch=1, lr=4.00e-05
""")


def test_the_console_gives_epoch_figures_to_the_second() -> None:
    records = parse_console(CONSOLE)
    assert [record["time"] for record in records if isinstance(record["message"], dict)] == [
        86399.0,
        86401.0,
        86403.0,
        86411.0,
        86412.0,
    ]  # past midnight the clock goes on
    summary = summarize_030(records, tokens_per_step=1000, per_step=False)
    first, second = summary["epochs"]
    assert (first["steps"], first["tokens_per_second"], first["first_step_seconds"]) == (
        3,
        500.0,
        1.0,
    )
    assert (second["steps"], second["tokens_per_second"], second["first_step_seconds"]) == (
        2,
        666.7,
        2.0,
    )
    assert first["validation_seconds"] == 1.0 and summary["checkpoint_save_seconds_each"] == [5.0]
    assert summary["median_step_tokens_per_second"] is None and summary["timed_steps"] == 0


def test_the_launcher_records_0_3_0s_log_records_with_their_times(tmp_path) -> None:
    # A stand-in for the 0.3.0 wheel (its dist-info gives the version) and for train.py: the
    # launcher runs the script as `python SCRIPT ARGS` would, with every `speculators` record
    # also written to the records file.
    site = tmp_path / "site"
    (site / "speculators").mkdir(parents=True)
    (site / "speculators" / "__init__.py").write_text("")
    (site / "speculators-0.3.0.dist-info").mkdir()
    (site / "speculators-0.3.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: speculators\nVersion: 0.3.0\n"
    )
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""\
        import logging, sys
        logging.basicConfig(level="INFO")
        logging.getLogger("speculators").info("Training epoch %d/%d started", 1, 1)
        logging.getLogger("speculators.metrics").info({"train": {"loss": 0.5}, "epoch": 0, "lr": 1e-4},
                                                      extra={"step": 0})
        logging.getLogger("other").info("not recorded")
        print("args", sys.argv[1:])
    """)
    )
    records = tmp_path / "records.jsonl"
    launcher = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_030.py"
    done = subprocess.run(
        [sys.executable, str(launcher), "--records", str(records), str(script), "--x", "1"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "args ['--x', '1']" in done.stdout
    assert f"speculators 0.3.0 from {site / 'speculators'}" in done.stdout
    found = read_records(records)
    assert [record["message"] for record in found] == [
        "Training epoch 1/1 started",
        {"train": {"loss": 0.5}, "epoch": 0, "lr": 1e-4},
    ]
    assert [record["logger"] for record in found] == ["speculators", "speculators.metrics"]
    assert 0 <= found[1]["time"] - found[0]["time"] < 5


def test_the_report_puts_0_3_0_beside_ours(tmp_path) -> None:
    assert make_parser().parse_args(["--sustained", "--with-030", ".whl"]).with_030 == ".whl"
    ours = {
        "name": "single",
        "processes": 1,
        "command": "ours",
        "median_tokens_per_second": None,
        "median_step_tokens_per_second": 60000.0,
        "epochs": [
            {
                "epoch": 0,
                "steps": 36,
                "tokens_per_second": 50000.0,
                "max_data_wait_seconds": 0.01,
                "first_step_seconds": 90.0,
            },
            {
                "epoch": 1,
                "steps": 36,
                "tokens_per_second": 60000.0,
                "max_data_wait_seconds": 0.01,
                "first_step_seconds": 0.1,
            },
        ],
    }
    theirs = {
        "name": NAME,
        "processes": 1,
        "command": "theirs",
        "error": None,
        "timing": "log record times",
        "packing": packing_030(8192, 2048, 144),
        **summarize_030(_records(), 1000, 3500),
    }
    assert markdown_lines([ours]) == []  # nothing to say without a 0.3.0 run
    lines = markdown_lines([ours, theirs])
    assert lines[-1] == (
        "Ours (`single`) / 0.3.0: median step 60.00x (60,000 / 1,000 tokens/s); "
        "per epoch: 0: 25.00x, 1: 77.14x"
    )
    assert "8188 real tokens per row of 4 samples" in lines[1] and "129 files" in lines[1]
    result = {
        "preset": "p",
        "command": "c",
        "environment": {},
        "samples": 144,
        "sample_tokens": 2048,
        "total_seq_len": 8192,
        "max_steps": 1,
        "warmup_steps": 1,
        "runs": [ours, theirs],
    }
    write_markdown(result, tmp_path / "report.md")
    report = (tmp_path / "report.md").read_text()
    assert f"Per epoch, `{NAME}`" in report and lines[-1] in report
    assert "| 0 | 4 | 2,000 | 2.00x |  |  | 30.0 |" in report  # no data-wait figure: blank


def test_the_launcher_refuses_our_own_speculators_alias(tmp_path) -> None:
    # Our checkout serves `speculators` as an alias of `speculators_vllm016`, beside it.
    (tmp_path / "speculators").mkdir()
    (tmp_path / "speculators" / "__init__.py").write_text("")
    (tmp_path / "speculators_vllm016").mkdir()
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    launcher = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_030.py"
    done = subprocess.run(
        [sys.executable, str(launcher), "--records", str(tmp_path / "r.jsonl"), str(script)],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "trained" not in done.stdout
    assert "no speculators 0.3.0 package to run" in done.stderr
