"""`speculators gen-and-train`: flags split among the stages; killed in training, run again, same result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculators_vllm016.cli.gen_and_train import main, plan_from_argv
from speculators_vllm016.demo import demo_conversations_path
from tests.train.test_trainer import assert_same_checkpoint
from tests.training_fixtures import cli_env, finished_checkpoints

BASE = ["--target-model-path", "model", "--train-data-path", "chat.jsonl", "--output-dir", "out"]


def test_flags_go_to_their_stage_and_the_layout_comes_from_output_dir():
    plan = plan_from_argv(
        BASE
        + [
            "--layer-ids",
            "0",
            "1",
            "2",
            "3",
            "--epochs",
            "2",
            "--max-samples",
            "5",
            "--lr",
            "0.01",
            "--seed",
            "7",
            "--no-progress",
        ]
    )
    assert plan.datagen.layer_ids == [0, 1, 2, 3] and plan.datagen.max_samples == 5
    assert plan.datagen.output_dir == str(Path("out") / "data") and plan.datagen.seed == 7
    train = plan.train.flat()  # the training job's config, by flag name
    assert train["epochs"] == 2 and train["lr"] == 0.01 and train["seed"] == 7
    assert train["data_path"] == str(Path("out") / "data")
    assert train["d2t_path"] == str(Path("out") / "vocab" / "d2t.npy")
    assert train["save_path"] == str(Path("out") / "checkpoints")
    assert train["verifier_name_or_path"] == "model" and train["no_progress"]
    assert plan.datagen.no_progress


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (BASE + ["--bogus", "1"], "unknown flag(s) --bogus 1"),
        (BASE + ["--data-path", "x"], "--data-path is set by gen-and-train"),
        (["--train-data-path", "chat.jsonl"], "needs --target-model-path, --output-dir"),
        (BASE + ["--epoch", "2"], "unknown flag(s) --epoch 2"),  # no prefix matching
        (BASE + ["--draft-vocab-size", "0"], "--draft-vocab-size must be at least 1, got 0"),
        (BASE + ["--draft-vocab-size", "-3"], "--draft-vocab-size must be at least 1, got -3"),
        (
            BASE + ["--draft-vocab-size", "64", "--target-vocab-size", "32"],
            "--draft-vocab-size 64 is larger than the target's vocabulary of 32 tokens",
        ),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "0.6"], "--temperature: a regeneration flag, used only with --regen"),
        (
            ["--max-tokens", "64", "--regenerate-seed", "3"],
            "--max-tokens, --regenerate-seed: regeneration flags, used only with --regenerate; "
            "add --regenerate or leave them out",
        ),
        (["--regenerate", "--num-shards", "2"], "gen-and-train --regenerate runs unsharded"),
        (["--regenerate", "--ray-address", "local"], "--regenerate does not run on Ray"),
        (["--regenerate", "--regenerate-dir", "x"], "--regenerate-dir is set by gen-and-train"),
        (["--regenerate", "--temperature", "-1"], "--temperature must be 0 or more, got -1.0"),
        (["--regenerate", "--chat-template-kwargs", "[1]"], "must be a JSON object"),
    ],
)
def test_regeneration_mistakes_are_one_line_errors_before_anything_is_written(
    extra, message, tmp_path, capsys
):
    argv = ["--target-model-path", "model", "--train-data-path", "chat.jsonl"]
    assert main([*argv, "--output-dir", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_regenerate_flags_go_to_the_one_pass_run_into_data_regenerated():
    plan = plan_from_argv(
        BASE + ["--regenerate", "--temperature", "0.6", "--regenerate-seed", "5", "--epochs", "2"]
    )
    assert plan.regenerate is not None and plan.datagen.regenerate
    assert plan.regenerate.output_dir == str(Path("out") / "data" / "regenerated")
    assert plan.regenerate.sampling.temperature == 0.6 and plan.regenerate.sampling.seed == 5
    assert plan.regenerate.sampling.max_tokens == 2048  # datagen --regenerate's default
    assert plan.train.flat()["epochs"] == 2
    assert plan_from_argv(BASE).regenerate is None


def test_help_lists_the_regeneration_flags_with_datagens_defaults(capsys):
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    for flag in ("--regenerate ", "--temperature", "--regenerate-seed", "--reasoning {keep,drop}"):
        assert flag in printed
    assert "At most this many per turn; None: 2048, lowered to fit" in " ".join(printed.split())


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_before_datagen(
    tiny_llama, tmp_path, capsys, monkeypatch
):
    from transformers import AutoConfig

    from speculators_vllm016.data_generation import offline

    def datagen(options):
        raise AssertionError("datagen started")

    monkeypatch.setattr(offline, "run_datagen", datagen)

    size = AutoConfig.from_pretrained(tiny_llama).vocab_size
    argv = [
        "--target-model-path",
        str(tiny_llama),
        "--train-data-path",
        str(demo_conversations_path()),
        "--output-dir",
        str(tmp_path / "out"),
        "--draft-vocab-size",
        str(size + 1),
    ]
    assert main(argv) == 2
    assert (
        f"--draft-vocab-size {size + 1} is larger than the target's vocabulary of {size} tokens"
        in (capsys.readouterr().err)
    )
    assert not (tmp_path / "out" / "data").exists()  # datagen never started


def _vocab_plan(root: Path, draft: int, target: int = 64):
    from types import SimpleNamespace

    from speculators_vllm016.pipeline.gen_and_train import PipelinePlan

    datagen = SimpleNamespace(output_dir=str(root / "data"), target_model_path="unused")
    return PipelinePlan(
        root=root,
        datagen=datagen,
        datagen_argv=[],
        train=None,
        draft_vocab_size=draft,
        target_vocab_size=target,
        debug=False,
    )


def test_vocabulary_maps_are_reused_only_while_their_sizes_match_the_flags(tmp_path, capsys):
    import numpy as np

    from speculators_vllm016.data_generation.token_counts import save_token_counts
    from speculators_vllm016.pipeline.gen_and_train import run_vocab_stage

    save_token_counts(
        {i: 100 - i for i in range(50)}, tmp_path / "data/token_freq/shard-0-of-1.pth"
    )
    d2t = tmp_path / "vocab" / "d2t.npy"
    run_vocab_stage(_vocab_plan(tmp_path, 32))
    assert len(np.load(d2t)) == 32
    capsys.readouterr()
    run_vocab_stage(_vocab_plan(tmp_path, 32))
    assert "done earlier" in capsys.readouterr().out
    run_vocab_stage(_vocab_plan(tmp_path, 16))
    out = capsys.readouterr().out
    assert "building them again (they map 32 of 64 tokens, the flags ask 16 of 64)" in out
    assert len(np.load(d2t)) == 16
    run_vocab_stage(_vocab_plan(tmp_path, 16, target=80))
    assert "they map 16 of 64 tokens, the flags ask 16 of 80" in capsys.readouterr().out
    assert len(np.load(tmp_path / "vocab" / "t2d.npy")) == 80
    run_vocab_stage(_vocab_plan(tmp_path, 16, target=80), data_changed=True)
    assert "building them again (datagen ran again)" in capsys.readouterr().out


def _pipeline(root: Path, target: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "speculators_vllm016",
        "gen-and-train",
        "--target-model-path",
        str(target),
        "--train-data-path",
        str(demo_conversations_path()),
        "--output-dir",
        str(root),
        "--max-samples",
        "16",
        "--seq-length",
        "64",
        "--draft-vocab-size",
        "64",
        "--layer-ids",
        "0",
        "1",
        "2",
        "3",
        "--batch-size",
        "8",
        "--num-preprocessing-workers",
        "1",
        "--total-seq-len",
        "256",
        "--epochs",
        "3",
        "--lr",
        "1e-3",
        "--num-workers",
        "0",
        "--checkpoint-freq",
        "0.25",
        "--no-progress",
        "--log-dir",
        str(root / "logs"),
    ]


@pytest.mark.engine
@pytest.mark.slow
def test_killed_in_training_and_run_again_ends_with_the_uninterrupted_checkpoint(
    tiny_llama, tmp_path
):
    straight = tmp_path / "straight"
    done = subprocess.run(
        _pipeline(straight, tiny_llama), env=cli_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = straight / "checkpoints" / "2"
    total = json.loads((last / "training_state.json").read_text())["global_step"]
    assert total >= 8

    # The resumed job starts from the same finished data (datagen's own resume is tested in
    # tests/data_generation); it is killed mid-training, once a mid-epoch checkpoint exists.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "data", resumed / "data")
    command = _pipeline(resumed, tiny_llama)
    process = subprocess.Popen(
        command,
        env=cli_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while process.poll() is None and not finished_checkpoints(resumed / "checkpoints"):
            time.sleep(0.02)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0, "the pipeline finished before the kill"
    assert not (resumed / "checkpoints" / "2").exists()

    again = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[1/3] datagen: done earlier" in again.stdout
    assert "[2/3] vocabulary maps: done earlier" in again.stdout
    assert "resuming from" in again.stderr
    assert_same_checkpoint(last, resumed / "checkpoints" / "2")


QUESTIONS = ["What is the capital of France?", "Numbers 0 1 2 3", "The quick brown fox"]


def _chat_rows(count: int) -> list[dict]:
    """Short rows whose shipped answers the target would never write."""
    rows = []
    for index in range(count):
        turns = [
            {"role": "user", "content": QUESTIONS[index % 3]},
            {"role": "assistant", "content": "a shipped answer"},
        ]
        if index % 2 == 0:
            turns += [
                {"role": "user", "content": QUESTIONS[(index + 1) % 3]},
                {"role": "assistant", "content": "another shipped answer"},
            ]
        rows.append({"messages": turns})
    return rows


def _regenerating(root: Path, target: Path, chat: Path) -> list[str]:
    return [
        "--target-model-path", str(target), "--train-data-path", str(chat),
        "--output-dir", str(root), "--regenerate", "--temperature", "0", "--max-tokens", "8",
        "--max-prompt-tokens", "128", "--seq-length", "192", "--dtype", "float32",
        "--draft-vocab-size", "64", "--layer-ids", "0", "1", "2", "3", "--batch-size", "4",
        "--num-preprocessing-workers", "1", "--total-seq-len", "256", "--epochs", "1",
        "--lr", "1e-3", "--num-workers", "0", "--no-progress", "--log-dir", str(root / "logs"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def regenerated_run(tiny_llama, tmp_path_factory):
    """`gen-and-train --regenerate` on the tiny Llama, then the same command again: what each
    call printed, how many hidden-states generators it started, the checkpoints' files after it."""
    import contextlib
    import io

    from speculators_vllm016.data_generation import vllm_hidden_states_generator as generator_module

    root = tmp_path_factory.mktemp("gen-and-train-regenerate") / "out"
    chat = root.parent / "chat.jsonl"
    chat.write_text("".join(json.dumps(row) + "\n" for row in _chat_rows(6)))
    started = []
    real_init = generator_module.VllmHiddenStatesGenerator.__init__

    def recording_init(self, *args, **kwargs):  # a spy: the real generator still starts
        started.append(kwargs)
        real_init(self, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(generator_module.VllmHiddenStatesGenerator, "__init__", recording_init)
    calls = []
    try:
        for _ in range(2):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                status = main(_regenerating(root, tiny_llama, chat))
            checkpoints = {  # the checkpoint folders' files (not the run's log and config)
                str(path.relative_to(root)): path.stat().st_mtime_ns
                for path in sorted((root / "checkpoints").glob("*/*"))
            }
            calls.append(
                {
                    "status": status,
                    "printed": printed.getvalue(),
                    "generators": len(started),
                    "checkpoints": checkpoints,
                }
            )
    finally:
        patch.undo()
    return root, calls


@pytest.mark.engine
def test_regenerate_trains_on_the_targets_own_answers_with_one_engine_load(
    regenerated_run, tiny_llama
):
    from transformers import AutoTokenizer

    from speculators_vllm016.data_generation.sample_io import load_sample

    root, (first, _) = regenerated_run
    assert first["status"] == 0, first["printed"][-3000:]
    assert first["generators"] == 1  # one engine answered the turns and extracted them
    assert f"[1/3] regeneration + datagen -> {root / 'data'}" in first["printed"]
    assert "regenerated: " in first["printed"]
    lines = (root / "data" / "regenerated" / "conversations.jsonl").read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines]
    assert len(conversations) == 6
    answers = [turn["content"] for c in conversations for turn in c if turn["role"] == "assistant"]
    assert len(answers) == 9 and not {"a shipped answer", "another shipped answer"} & set(answers)

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rendered = sorted(
        tuple(
            tokenizer(
                tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False
            ).input_ids[:192]
        )
        for c in conversations
    )
    samples = sorted((root / "data").glob("data_*.pt"))
    assert len(samples) == 6
    assert sorted(tuple(load_sample(path)["input_ids"].tolist()) for path in samples) == rendered
    assert "0" in finished_checkpoints(root / "checkpoints")  # one epoch trained


@pytest.mark.engine
def test_regenerate_run_again_reuses_every_stage(regenerated_run):
    _, (first, second) = regenerated_run
    assert second["status"] == 0, second["printed"][-3000:]
    assert second["generators"] == 1  # no engine started by the second call
    assert "[1/3] regeneration + datagen: done earlier" in second["printed"]
    assert "[2/3] vocabulary maps: done earlier" in second["printed"]
    assert first["checkpoints"] and second["checkpoints"] == first["checkpoints"]  # no step more
