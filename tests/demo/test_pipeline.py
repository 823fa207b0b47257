"""The demo summary's training throughput: right after a resumed training call too."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.demo.pipeline import read_training_metrics, training_throughput


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


def test_each_stage_depends_on_its_options_and_every_earlier_stages():
    from dataclasses import fields, replace

    from speculators_vllm016.demo.pipeline import DemoOptions, stage_options

    base = DemoOptions()
    names = list(stage_options(base))
    assert names == ["target", "datagen", "vocab", "initial draft", "train", "eval"]
    # Every option but where the output goes and the progress bars changes some stage.
    ignored = {"output_dir", "show_progress"}
    assert set(stage_options(base)["eval"]) == {f.name for f in fields(DemoOptions)} - ignored

    def changed(**change) -> list[str]:
        before, after = stage_options(base), stage_options(replace(base, **change))
        return [name for name in names if before[name] != after[name]]

    assert changed(epochs=7) == ["train", "eval"]
    assert changed(draft_vocab_size=64) == ["vocab", "initial draft", "train", "eval"]
    assert changed(max_samples=20) == names[1:]
    assert changed(seed=1) == names
    assert changed(max_new_tokens=8) == ["eval"]


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

    from speculators_vllm016.demo.pipeline import DemoOptions

    base = DemoOptions()
    ran: list[str] = []
    _stages(tmp_path, base, ran)
    assert len(ran) == 6
    ran.clear()
    assert all(record.reused for record in _stages(tmp_path, base, ran)) and ran == []

    records = _stages(tmp_path, replace(base, epochs=7), ran)
    assert ran == ["train", "eval"]  # their old outputs were removed first
    assert [r.reused for r in records] == [True] * 4 + [False] * 2
    assert "train: running it again (epochs: 2 -> 7)" in capsys.readouterr().out
    assert json.loads((tmp_path / "train" / "out").read_text())["epochs"] == 7

    # A crash in eval, then a rerun with other options: train and eval run again.
    ran.clear()
    with pytest.raises(RuntimeError, match="eval crashed"):
        _stages(tmp_path, replace(base, epochs=3), ran, fail="eval")
    assert ran == ["train"]
    ran.clear()
    _stages(tmp_path, replace(base, epochs=5), ran)
    assert ran == ["train", "eval"]  # eval's partial output of epochs=3 was removed

    # Interrupted with the same options: the stage resumes over what it left.
    ran.clear()
    with pytest.raises(RuntimeError):
        _stages(tmp_path, replace(base, epochs=6), ran, fail="eval")
    ran.clear()
    _stages(tmp_path, replace(base, epochs=6), ran)
    assert ran == ["eval (over old output)"]  # train finished with these options; eval resumes


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
