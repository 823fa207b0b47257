"""The demo's pure logic: training throughput after a resumed call, the stages' options and
reruns, and the held-out split."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.demo.draft_training import read_training_metrics, training_throughput


def _write_metrics(path, tokens_per_step: list[int]) -> None:
    """metrics.jsonl as the trainer writes it: one train line per step, a validation line."""
    lines = [
        {
            "step": step,
            "train": {"loss": 1.0, "full_acc_0": 0.5, "tokens": tokens, "step_seconds": 0.5},
            "epoch": 0,
            "lr": 1e-3,
        }
        for step, tokens in enumerate(tokens_per_step)
    ]
    lines.append({"step": len(tokens_per_step), "val": {"loss_epoch": 1.0}, "epoch": 0})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_resumed_run_is_timed_by_its_steps_not_by_the_last_call(tmp_path):
    # Ten steps of 100 tokens, 0.5 s each: 200 tokens/s. The resumed call ran only the last
    # three steps (1.5 s), which must not become 1000 tokens / 1.5 s.
    metrics_file = tmp_path / "metrics.jsonl"
    _write_metrics(metrics_file, [100] * 10)
    metrics = read_training_metrics(metrics_file)
    tokens, rate = training_throughput(metrics, call_seconds=1.5)
    assert tokens == 1000
    assert rate == pytest.approx(200.0)


def test_lines_without_step_times_fall_back_to_the_call_time():
    tokens, rate = training_throughput([{"step": 0, "tokens": 300}], call_seconds=3.0)
    assert (tokens, rate) == (300, pytest.approx(100.0))
    assert training_throughput([], call_seconds=0.0) == (0, 0.0)


ALL_STAGES = [
    "split",
    "target",
    "datagen",
    "vocab",
    "initial draft",
    "train",
    "regen datagen",
    "regen vocab",
    "regen train",
    "eval",
    "serve",
]


def test_each_stage_depends_on_its_options_and_those_of_the_stages_it_reads():
    from dataclasses import fields, replace

    from speculators_vllm016.demo.options import DemoOptions
    from speculators_vllm016.demo.pipeline import stage_options

    base = DemoOptions()
    names = list(stage_options(base))
    assert names == ALL_STAGES
    # Every option but where the output goes and the progress bars changes some stage.
    ignored = {"output_dir", "show_progress"}
    assert set(stage_options(base)["serve"]) == {f.name for f in fields(DemoOptions)} - ignored

    def changed(**change) -> list[str]:
        before, after = stage_options(base), stage_options(replace(base, **change))
        return [name for name in names if before[name] != after[name]]

    assert changed(epochs=7) == ["train", "regen train", "eval", "serve"]
    assert changed(draft_vocab_size=64) == [
        "vocab",
        "initial draft",
        "train",
        "regen vocab",
        "regen train",
        "eval",
        "serve",
    ]
    assert changed(max_samples=20) == names
    assert changed(held_out_every=5) == names
    assert changed(seed=1) == names[1:]
    assert changed(seq_length=512) == names[2:]
    assert changed(max_new_tokens=8) == ["eval", "serve"]
    # The drafts' window retrains both drafts; the long prompts' length only serves again.
    assert changed(sliding_window=64) == ["train", "regen train", "eval", "serve"]
    assert changed(long_context=900) == ["serve"]
    # The target's long rows change the target, so everything after the split.
    assert changed(target_long_row_tokens=1024) == names[1:]
    assert changed(target_long_every=2) == names[1:]
    # The regeneration's own options leave the target, the shipped draft and their data alone.
    assert changed(regenerate_max_tokens=16) == [
        "regen datagen",
        "regen vocab",
        "regen train",
        "eval",
        "serve",
    ]


def test_without_regeneration_its_stages_are_left_out_and_the_evaluation_runs_again():
    from dataclasses import replace

    from speculators_vllm016.demo.options import DemoOptions
    from speculators_vllm016.demo.pipeline import REGENERATION_STAGES, stage_options

    on, off = stage_options(DemoOptions()), stage_options(replace(DemoOptions(), regenerate=False))
    assert list(off) == [name for name in ALL_STAGES if name not in REGENERATION_STAGES]
    assert [name for name in off if off[name] != on[name]] == ["eval", "serve"]
    assert "regenerate_max_tokens" not in off["eval"]
    assert list(stage_options(replace(DemoOptions(), serve=False))) == ALL_STAGES[:-1]


def _stages(root, options, ran: list[str], fail: str | None = None):
    """The demo's stage sequence with stand-in work: each stage writes <root>/<name>/out and
    notes whether the folder held an older output when its work began."""
    from speculators_vllm016.demo.pipeline import _load_state, _run_stage, stage_options

    state = _load_state(root)
    records = []
    for name, depends in stage_options(options).items():
        folder = root / name.replace(" ", "-")

        def work(name=name, folder=folder):
            if name == fail:  # leaves a partial output behind
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "out").write_text("partial")
                raise RuntimeError(f"{name} crashed")
            ran.append(name + (" (over old output)" if (folder / "out").exists() else ""))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "out").write_text(json.dumps(depends))  # noqa: B023 - called in this iteration
            return {"out": str(folder / "out")}, {"value": len(ran)}

        records.append(_run_stage(root, state, name, work, depends, [folder]))
    return records


def test_a_stage_whose_options_changed_runs_again_from_scratch_with_every_later_stage(
    tmp_path, capsys
):
    from dataclasses import replace

    from speculators_vllm016.demo.options import DemoOptions

    base = DemoOptions()
    ran: list[str] = []
    _stages(tmp_path, base, ran)
    assert len(ran) == 11
    ran.clear()
    assert all(record.reused for record in _stages(tmp_path, base, ran)) and ran == []

    records = _stages(tmp_path, replace(base, epochs=7), ran)
    assert ran == ["train", "regen train", "eval", "serve"]  # old outputs were removed first
    assert [r.reused for r in records] == [True] * 5 + [False, True, True, False, False, False]
    assert "train: running it again (epochs: 3 -> 7)" in capsys.readouterr().out
    assert json.loads((tmp_path / "train" / "out").read_text())["epochs"] == 7

    # A crash in eval, then a rerun with other options: train and eval run again.
    ran.clear()
    with pytest.raises(RuntimeError, match="eval crashed"):
        _stages(tmp_path, replace(base, epochs=3), ran, fail="eval")
    assert ran == ["train", "regen train"]
    ran.clear()
    _stages(tmp_path, replace(base, epochs=5), ran)
    assert ran == ["train", "regen train", "eval", "serve"]  # eval's partial output was removed

    # Interrupted with the same options: the stage resumes over what it left.
    ran.clear()
    with pytest.raises(RuntimeError):
        _stages(tmp_path, replace(base, epochs=6), ran, fail="eval")
    ran.clear()
    _stages(tmp_path, replace(base, epochs=6), ran)
    assert ran == ["eval (over old output)", "serve"]  # train finished with these options


def test_a_stage_never_removes_anything_outside_the_demo_folder(tmp_path):
    from speculators_vllm016.demo.pipeline import _load_state, _run_stage

    root, elsewhere = tmp_path / "demo", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    state = _load_state(root)
    _run_stage(root, state, "train", lambda: ({}, {}), {"epochs": 1}, [root / "checkpoints"])
    with pytest.raises(ValueError, match="outside"):
        _run_stage(root, state, "train", lambda: ({}, {}), {"epochs": 2}, [elsewhere])
    assert elsewhere.is_dir()
    with pytest.raises(ValueError, match="outside"):
        _run_stage(root, state, "train", lambda: ({}, {}), {"epochs": 2}, [root / ".." / "x"])


def _row(opening, *later):
    """A ShareGPT row asking `opening`, then each of `later`, every question answered."""
    turns = []
    for question in (opening, *later):
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": "an answer"}]
    return json.dumps({"conversations": turns})


def test_held_out_questions_are_asked_in_no_training_row():
    from speculators_vllm016.demo.held_out import row_questions, split_rows

    lines = [
        _row("q0"),
        _row("q1"),
        _row("q0", "q1"),  # asks the held-out q1 later on: set aside
        _row("q2"),
        _row("q3"),
        _row("q1"),  # q1 again: held out already, set aside
        _row("q4", "more?"),
        _row("q5"),
        "not json",  # trains (datagen skips it), never prompts
        json.dumps({"conversations": [{"from": "system", "value": "s"}]}),
    ]
    rows = [row_questions(line) for line in lines]
    assert rows[6].opening == "q4" and rows[6].asked == {"q4", "more?"}
    assert rows[8].opening is None and rows[9].opening is None
    split = split_rows(rows, 2, 3)
    assert split.questions == ["q1", "q3", "q5"]  # every 2nd distinct opening question
    assert split.held_out == [1, 4, 7]  # the first row asking each
    assert split.set_aside == [2, 5]
    assert split.target == [0, 3, 6, 8, 9]
    assert split.drafts == [0, 3, 6]
    assert split_rows(rows, 2, None).drafts == split.target


def test_on_the_shipped_conversations_no_evaluation_prompt_is_a_training_prompt():
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.held_out import row_questions, split_of_file
    from speculators_vllm016.demo.options import DemoOptions

    options = DemoOptions()
    lines, split = split_of_file(demo_conversations_path(), options.held_out_every, 160)
    assert len(split.held_out) >= options.eval_prompts and len(split.drafts) == 160
    asked_in_training = set().union(*(row_questions(lines[i]).asked for i in split.target))
    held = [row_questions(lines[i]).opening for i in split.held_out]
    assert len(set(held)) == len(held) and not set(held) & asked_in_training
    parts = split.target + split.held_out + split.set_aside
    assert sorted(parts) == list(range(len(lines)))


@pytest.mark.parametrize(
    ("every", "draft_rows", "eval_prompts", "flag"),
    [
        (1, 160, 24, "--held-out-every"),
        (6, 271, 24, "--max-samples"),
        (6, 0, 24, "--max-samples"),
        (6, 160, 37, "--eval-prompts"),
        (20, 160, 24, "--eval-prompts"),
    ],
)
def test_a_split_that_would_cut_something_short_is_refused_in_one_line(
    every, draft_rows, eval_prompts, flag
):
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.held_out import check_every, check_split, split_of_file
    from speculators_vllm016.utils.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as refused:
        check_every(every)
        _, split = split_of_file(demo_conversations_path(), every, draft_rows)
        check_split(split, draft_rows, eval_prompts)
    assert str(refused.value).startswith(flag) and "\n" not in str(refused.value)


def test_the_split_files_hold_the_rows_verbatim(tmp_path):
    from speculators_vllm016.demo.held_out import (
        DRAFT_FILE,
        HELD_OUT_FILE,
        TARGET_FILE,
        split_of_file,
        write_split,
    )

    shipped = tmp_path / "shipped.jsonl"
    shipped.write_text("".join(_row(f"q{i}") + "\n\n" for i in range(9)))  # blank lines too
    lines, split = split_of_file(shipped, 3, 4)
    write_split(lines, split, tmp_path / "parts")

    def questions(name):
        text = (tmp_path / "parts" / name).read_text()
        return [json.loads(line)["conversations"][0]["value"] for line in text.splitlines()]

    assert questions(HELD_OUT_FILE) == ["q2", "q5", "q8"]
    assert questions(TARGET_FILE) == ["q0", "q1", "q3", "q4", "q6", "q7"]
    assert questions(DRAFT_FILE) == ["q0", "q1", "q3", "q4"]
    assert (tmp_path / "parts" / DRAFT_FILE).read_text().splitlines()[0] == _row("q0")


def test_a_user_mistake_in_the_split_is_refused_before_the_demo_folder_is_made(tmp_path, capsys):
    from speculators_vllm016.demo.cli import main

    output = tmp_path / "demo"
    assert main(["--output-dir", str(output), "--eval-prompts", "40", "--no-progress"]) == 2
    assert not output.exists()
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--eval-prompts" in error and "36 held-out" in error


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--long-context", "2040"], "--long-context must be between 0 and 2016"),
        (["--long-context", "-1"], "--long-context must be between 0 and 2016"),
        (
            ["--sliding-window", "2"],
            "--sliding-window must be 0 (full attention) or at least the 3",
        ),
        (
            ["--target-long-row-tokens", "4096"],
            "--target-long-row-tokens must be between 0 and the target's 2048 positions",
        ),
        (["--target-long-every", "0"], "--target-long-every must be at least 1"),
    ],
)
def test_long_prompts_past_the_targets_positions_or_a_window_too_short_are_refused(
    flags, named, tmp_path, capsys
):
    from speculators_vllm016.demo.cli import main

    output = tmp_path / "demo"
    assert main(["--output-dir", str(output), *flags, "--no-progress"]) == 2
    assert not output.exists()
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and named in error


def test_a_window_of_zero_is_full_attention():
    from speculators_vllm016.demo.cli import build_parser, options_from_args

    parse = build_parser().parse_args
    assert options_from_args(parse(["--sliding-window", "0"])).sliding_window is None
    assert options_from_args(parse(["--sliding-window", "64"])).sliding_window == 64


def test_the_summary_without_regeneration_names_the_held_out_rows_and_two_taus(capsys, tmp_path):
    from speculators_vllm016.demo.cli import print_summary
    from speculators_vllm016.demo.pipeline import DemoResult, StageRecord

    training = {"steps": 3, "first_loss": 2.0, "last_loss": 1.0, "tokens_per_second": 10.0}
    figures = {
        "split": {"rows": 320, "target_rows": 270, "draft_rows": 160, "set_aside_rows": 14},
        "target": {"first_loss": 5.0, "last_loss": 2.0, "tokens_per_second": 1.0},
        "datagen": {"samples": 160, "tokens": 1000, "tokens_per_second": 1.0},
        "train": training,
        "eval": {"prompts": 24, "table": "TABLE", "tau_untrained": 1.0, "tau_shipped": 2.5},
    }
    figures["split"]["held_out_rows"] = [5, 11, 17, 24]
    stages = [StageRecord(name, 1.0, {}, values) for name, values in figures.items()]
    print_summary(DemoResult(root=tmp_path, stages=stages))
    printed = capsys.readouterr().out
    assert "24 held-out prompts" in printed and "(rows 5, 11, 17, ..., 24 of the shipped" in printed
    assert "tau: untrained 1.000, shipped 2.500\n" in printed
    assert "regenerat" not in printed


def test_the_command_lines_defaults_are_the_options_defaults():
    """Each flag's default is `DemoOptions`' (one declaration): the command line given nothing
    asks for exactly the default demo, and `--help` shows the defaults the demo runs with."""
    from speculators_vllm016.demo.cli import build_parser, options_from_args
    from speculators_vllm016.demo.options import DemoOptions

    assert options_from_args(build_parser().parse_args([])) == DemoOptions()
