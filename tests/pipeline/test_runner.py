"""The stage runner: reuse, rerun on changed options or a rerun upstream stage, resume after a crash."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from speculators_vllm016.pipeline.ledgers import DoneFile, NoRecord, StateFile
from speculators_vllm016.pipeline.runner import Rerun, Stage, StageRunner


@dataclass
class Written:
    path: str
    size: int


def _stage(root: Path, ledger, options: dict, ran: list[str], name: str = "make", **kwargs):
    """A stage writing <root>/<name>/out, noting whether an older output was there."""
    folder = root / name

    def run() -> Written:
        ran.append(name + (" over old output" if (folder / "out").exists() else ""))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "out").write_text(json.dumps(options))
        return Written(path=str(folder / "out"), size=len(ran))

    return Stage(
        name=name,
        run=run,
        ledger=ledger,
        options=options,
        clear_on_change=(folder,),
        output_type=Written,
        **kwargs,
    )


def test_a_finished_stage_with_the_same_options_is_reused_with_its_typed_output(tmp_path):
    ran: list[str] = []
    first = StageRunner().run(_stage(tmp_path, StateFile(tmp_path / "s.json"), {"a": 1}, ran))
    assert not first.reused and first.output == Written(str(tmp_path / "make" / "out"), 1)
    again = StageRunner().run(_stage(tmp_path, StateFile(tmp_path / "s.json"), {"a": 1}, ran))
    assert again.reused and again.output == first.output and ran == ["make"]
    assert again.seconds == first.seconds  # the recorded time, not this call's


def test_changed_options_remove_the_old_outputs_and_run_again(tmp_path):
    ran: list[str] = []
    told: list[Rerun] = []
    StageRunner().run(_stage(tmp_path, StateFile(tmp_path / "s.json"), {"a": 1}, ran))
    again = StageRunner().run(
        _stage(tmp_path, StateFile(tmp_path / "s.json"), {"a": 2}, ran, on_rerun=told.append)
    )
    assert not again.reused and ran == ["make", "make"]  # not "over old output"
    assert told == [Rerun(before={"a": 1}, now={"a": 2}, upstream=())]


def test_a_stage_interrupted_with_the_same_options_resumes_over_its_output(tmp_path):
    state = tmp_path / "s.json"
    (tmp_path / "make").mkdir()
    (tmp_path / "make" / "out").write_text("partial")

    def crash() -> Written:
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        StageRunner().run(Stage("make", crash, StateFile(state), {"a": 1}, output_type=Written))
    assert json.loads(state.read_text()) == {"make": {"options": {"a": 1}}}  # started, not done
    ran: list[str] = []
    StageRunner().run(_stage(tmp_path, StateFile(state), {"a": 1}, ran))
    assert ran == ["make over old output"]


def test_a_stage_runs_again_when_a_stage_it_follows_ran_in_this_call(tmp_path):
    ran: list[str] = []
    told: list[Rerun] = []
    ledger = StateFile(tmp_path / "s.json")
    StageRunner().run(_stage(tmp_path, ledger, {}, ran, name="first"))
    StageRunner().run(_stage(tmp_path, ledger, {}, ran, name="second", after=("first",)))
    ran.clear()
    runner = StageRunner(ran={"first"})
    outcome = runner.run(
        _stage(tmp_path, ledger, {}, ran, name="second", after=("first",), on_rerun=told.append)
    )
    assert not outcome.reused and ran == ["second over old output"]  # same options: kept
    assert told == [Rerun(before={}, now={}, upstream=("first",))]
    assert "second" in runner.ran
    ran.clear()
    again = StageRunner().run(_stage(tmp_path, ledger, {}, ran, name="second", after=("first",)))
    assert again.reused and ran == []


def test_a_done_file_is_written_only_when_the_stage_finished(tmp_path):
    done = tmp_path / "data" / ".done.json"
    (tmp_path / "data").mkdir()

    def crash() -> None:
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        StageRunner().run(Stage("datagen", crash, DoneFile(done), {"seed": 1}))
    assert not done.exists()
    outcome = StageRunner().run(Stage("datagen", lambda: 5, DoneFile(done), {"seed": 1}))
    assert outcome.output == 5 and json.loads(done.read_text()) == {"seed": 1}
    reused = StageRunner().run(Stage("datagen", lambda: 6, DoneFile(done), {"seed": 1}))
    assert reused.reused and reused.output is None  # a done file keeps no output


def test_a_stage_without_a_record_always_runs(tmp_path):
    calls: list[int] = []
    for _ in range(2):
        outcome = StageRunner().run(Stage("train", lambda: calls.append(1) or 0, NoRecord()))
        assert not outcome.reused and outcome.output == 0
    assert len(calls) == 2
