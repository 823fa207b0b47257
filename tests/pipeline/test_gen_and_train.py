"""gen-and-train's chain on the runner: which stage runs again, in the words users read.

Datagen and training are stand-ins here (the real chain, killed and resumed, is
tests/cli/test_gen_and_train.py's engine test); the vocabulary maps are built for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from speculators_vllm016.cli.gen_and_train import plan_from_argv
from speculators_vllm016.data_generation import offline
from speculators_vllm016.data_generation.regeneration.one_pass import prepare_one_pass
from speculators_vllm016.data_generation.token_counts import save_token_counts
from speculators_vllm016.pipeline.gen_and_train import DATAGEN_DONE, run_gen_and_train
from speculators_vllm016.utils.errors import InvalidInputError


def _argv(root: Path, *extra: str) -> list[str]:
    return [
        "--target-model-path",
        "model",
        "--train-data-path",
        "chat.jsonl",
        "--output-dir",
        str(root),
        "--draft-vocab-size",
        "16",
        "--target-vocab-size",
        "64",
        *extra,
    ]


@pytest.fixture
def stand_ins(monkeypatch):
    """Datagen writes token counts (or fails on request); training notes that it started."""
    calls: dict[str, list] = {"datagen": [], "train": []}
    failing = []

    def datagen(options):
        if failing:
            raise InvalidInputError("the chat file has no usable row")
        calls["datagen"].append(options.max_samples)
        folder = Path(options.output_dir)
        save_token_counts({i: 100 - i for i in range(40)}, folder / "token_freq/shard-0-of-1.pth")
        return offline.DatagenSummary(str(folder), 4, 4, 0, 40, 1.0, 0.5)

    def train(config) -> int:
        calls["train"].append(config.checkpoint.save_path)
        return 0

    monkeypatch.setattr(offline, "run_datagen", datagen)
    return calls, train, failing


def test_a_rerun_skips_done_stages_and_datagen_running_again_rebuilds_the_maps(
    tmp_path, capsys, stand_ins
):
    calls, train, _ = stand_ins
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    out = capsys.readouterr().out
    assert f"[1/3] datagen -> {tmp_path / 'data'}" in out
    assert f"[2/3] vocabulary maps: 16 of 64 tokens -> {tmp_path / 'vocab'}" in out
    assert f"[3/3] training -> {tmp_path / 'checkpoints'}" in out
    assert (tmp_path / "data" / DATAGEN_DONE).is_file()
    assert len(np.load(tmp_path / "vocab" / "d2t.npy")) == 16

    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    out = capsys.readouterr().out
    assert "[1/3] datagen: done earlier" in out and "[2/3] vocabulary maps: done earlier" in out
    assert calls["datagen"] == [None] and len(calls["train"]) == 2  # training always starts

    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, "--max-samples", "3")), train) == 0
    out = capsys.readouterr().out
    assert calls["datagen"] == [None, 3]
    assert "vocabulary maps in" in out and "building them again (datagen ran again)" in out


def test_a_failed_datagen_is_one_line_and_neither_recorded_nor_followed_by_training(
    tmp_path, capsys, stand_ins
):
    calls, train, failing = stand_ins
    failing.append(True)
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 2
    assert "the chat file has no usable row" in capsys.readouterr().err
    assert not (tmp_path / "data" / DATAGEN_DONE).exists()
    assert calls["train"] == [] and not (tmp_path / "vocab").exists()


@pytest.fixture
def one_pass(monkeypatch, stand_ins):
    """The one-pass run (`run_datagen_regenerating`) as a stand-in: it notes its temperature and
    what the output folder held when it started, writes a conversations file and token counts,
    and fails on request; the engine-free checks pass unless a test sets its own."""
    from speculators_vllm016.data_generation.regeneration import one_pass as module
    from speculators_vllm016.data_generation.regeneration.run import RegenerateSummary

    calls, train, _ = stand_ins
    calls["one_pass"] = []
    interrupted = []

    def run(options, regenerate):
        data = Path(options.output_dir)
        root = data.parent
        calls["one_pass"].append(
            {
                "temperature": regenerate.sampling.temperature,
                "regenerate_dir": regenerate.output_dir,
                "found": sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()),
            }
        )
        folder = Path(regenerate.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "conversations.jsonl").write_text(f"{regenerate.sampling.temperature}\n")
        if interrupted:
            raise InvalidInputError("stopped half-way")
        save_token_counts({i: 100 - i for i in range(40)}, data / "token_freq/shard-0-of-1.pth")
        regenerated = RegenerateSummary(str(folder / "conversations.jsonl"), 4, 4, 0, 0)
        return regenerated, offline.DatagenSummary(str(data), 4, 4, 0, 40, 1.0, 0.5)

    monkeypatch.setattr(module, "run_datagen_regenerating", run)
    monkeypatch.setattr(module, "prepare_one_pass", lambda options, regenerate: (options, None))
    return calls, train, interrupted


def _old_checkpoint(save: Path) -> Path:
    """A checkpoint of an earlier call's training in `save`."""
    checkpoint = save / "0" / "training_state.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("{}")
    return checkpoint


def test_regenerate_runs_one_pass_into_data_and_a_rerun_reuses_it(tmp_path, capsys, one_pass):
    calls, train, _ = one_pass
    argv = _argv(tmp_path, "--regenerate", "--temperature", "0.6")
    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    out = capsys.readouterr().out
    assert f"[1/3] regeneration + datagen -> {tmp_path / 'data'}" in out
    assert "      regenerated: 4 rows regenerated" in out
    assert f"[2/3] vocabulary maps: 16 of 64 tokens -> {tmp_path / 'vocab'}" in out
    assert [call["regenerate_dir"] for call in calls["one_pass"]] == [
        str(tmp_path / "data" / "regenerated")
    ]
    assert calls["datagen"] == []  # plain datagen never ran

    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    out = capsys.readouterr().out
    assert "[1/3] regeneration + datagen: done earlier" in out
    assert "[2/3] vocabulary maps: done earlier" in out
    assert len(calls["one_pass"]) == 1 and len(calls["train"]) == 2


def test_changed_regeneration_flags_remove_the_old_run_then_regenerate_extract_and_train_anew(
    tmp_path, capsys, one_pass
):
    calls, train, _ = one_pass
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, "--regenerate")), train) == 0
    checkpoint = _old_checkpoint(tmp_path / "checkpoints")
    capsys.readouterr()

    argv = _argv(tmp_path, "--regenerate", "--temperature", "0")
    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    out = capsys.readouterr().out
    assert (
        "[1/3] regeneration + datagen: the flags differ from the finished run's "
        "(temperature: None -> 0.0); removing its data, maps and checkpoints and starting over"
    ) in out
    assert calls["one_pass"][1]["found"] == []  # no old row, map or checkpoint was left
    assert not checkpoint.exists()  # training starts from scratch
    assert f"[2/3] vocabulary maps: 16 of 64 tokens -> {tmp_path / 'vocab'}" in out  # built anew
    regenerated = tmp_path / "data" / "regenerated" / "conversations.jsonl"
    assert regenerated.read_text() == "0.0\n"

    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    assert "[1/3] regeneration + datagen: done earlier" in capsys.readouterr().out
    assert len(calls["one_pass"]) == 2


def test_switching_between_plain_and_regenerated_data_starts_over_both_ways(
    tmp_path, capsys, one_pass
):
    calls, train, _ = one_pass
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    _old_checkpoint(tmp_path / "checkpoints")
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, "--regenerate")), train) == 0
    out = capsys.readouterr().out
    assert "regenerate: False -> True" in out, out
    assert calls["one_pass"][0]["found"] == []

    _old_checkpoint(tmp_path / "checkpoints")
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    out = capsys.readouterr().out
    assert "[1/3] datagen: the flags differ from the finished run's (" in out, out
    assert "regenerate: True -> False)" in out, out
    assert not (tmp_path / "data" / "regenerated").exists()
    assert not (tmp_path / "checkpoints" / "0").exists()
    assert calls["datagen"] == [None, None]


def test_an_interrupted_one_pass_run_resumes_what_it_left(tmp_path, capsys, one_pass):
    calls, train, interrupted = one_pass
    argv = _argv(tmp_path, "--regenerate")
    interrupted.append(True)
    assert run_gen_and_train(plan_from_argv(argv), train) == 2
    assert not (tmp_path / "data" / DATAGEN_DONE).exists() and calls["train"] == []
    capsys.readouterr()

    interrupted.clear()
    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    out = capsys.readouterr().out
    assert (
        "[1/3] regeneration + datagen -> " in out and "(resuming the unfinished run there)" in out
    )
    assert calls["one_pass"][1]["found"] == ["data/regenerated/conversations.jsonl"]  # kept


@pytest.mark.parametrize("save", ["elsewhere", "out"])  # another folder; the output folder
def test_checkpoints_outside_the_output_folder_are_not_removed_but_refused(
    save, tmp_path, capsys, one_pass
):
    calls, train, _ = one_pass
    elsewhere = tmp_path / save
    argv = _argv(tmp_path / "out", "--regenerate", "--save-path", str(elsewhere))
    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    checkpoint = _old_checkpoint(elsewhere)
    capsys.readouterr()
    changed = [*argv, "--temperature", "0"]
    assert run_gen_and_train(plan_from_argv(changed), train) == 2
    err = capsys.readouterr().err
    assert f"--save-path {elsewhere} holds checkpoints trained on the earlier run's data" in err
    assert (tmp_path / "out" / "data" / DATAGEN_DONE).is_file() and checkpoint.exists()
    assert len(calls["one_pass"]) == 1


def test_a_record_written_before_the_newer_datagen_flags_is_still_done(tmp_path, capsys, stand_ins):
    calls, train, _ = stand_ins
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    record = tmp_path / "data" / DATAGEN_DONE
    older = json.loads(record.read_text())
    newer = ("regenerate", "temperature", "max_tokens", "reasoning", "storage_dtype")
    newer += ("ray_address", "ray_max_retries", "session_tokens", "sessions_only")
    record.write_text(json.dumps({k: v for k, v in older.items() if k not in newer}))
    capsys.readouterr()
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    out = capsys.readouterr().out
    assert "[1/3] datagen: done earlier" in out and "[2/3] vocabulary maps: done earlier" in out
    assert calls["datagen"] == [None]


def test_the_session_flags_are_in_datagens_record_and_a_change_runs_datagen_again(
    tmp_path, capsys, stand_ins
):
    """(Plain datagen then finds its folder's samples differ and refuses it naming the flag:
    tests/data_generation/test_sessions.py.)"""
    calls, train, _ = stand_ins
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path)), train) == 0
    sessions = [*_argv(tmp_path, "--session-tokens", "1000"), "--sessions-only"]
    assert run_gen_and_train(plan_from_argv(sessions), train) == 0
    assert len(calls["datagen"]) == 2
    record = json.loads((tmp_path / "data" / DATAGEN_DONE).read_text())
    assert record["session_tokens"] == 1000 and record["sessions_only"] is True
    capsys.readouterr()
    assert run_gen_and_train(plan_from_argv(sessions), train) == 0
    assert "[1/3] datagen: done earlier" in capsys.readouterr().out
    assert len(calls["datagen"]) == 2


def test_a_mistake_in_the_changed_flags_is_refused_before_the_old_run_is_removed(
    tmp_path, capsys, one_pass, monkeypatch
):
    from speculators_vllm016.data_generation.regeneration import one_pass as module

    calls, train, _ = one_pass
    argv = _argv(tmp_path, "--regenerate", "--seq-length", "32")
    assert run_gen_and_train(plan_from_argv(argv), train) == 0
    checkpoint = _old_checkpoint(tmp_path / "checkpoints")
    monkeypatch.setattr(module, "prepare_one_pass", prepare_one_pass)  # the real checks
    capsys.readouterr()
    changed = [*argv, "--max-model-len", "100", "--max-prompt-tokens", "64", "--max-tokens", "64"]
    assert run_gen_and_train(plan_from_argv(changed), train) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 100 is shorter than --max-prompt-tokens + --max-tokens (128)" in err
    assert checkpoint.exists() and (tmp_path / "data" / DATAGEN_DONE).is_file()
    assert (tmp_path / "data" / "regenerated" / "conversations.jsonl").is_file()
    assert len(calls["one_pass"]) == 1


def test_a_mistake_in_a_plain_run_after_a_regenerated_one_keeps_the_old_run(
    tmp_path, capsys, one_pass
):
    calls, train, _ = one_pass
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, "--regenerate")), train) == 0
    checkpoint = _old_checkpoint(tmp_path / "checkpoints")
    capsys.readouterr()
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, "--max-samples", "0")), train) == 2
    assert "--max-samples must be at least 1, got 0" in capsys.readouterr().err
    assert checkpoint.exists() and (tmp_path / "data" / "regenerated").is_dir()
    assert calls["datagen"] == []


@pytest.fixture
def ray_stand_in(monkeypatch, stand_ins):
    """Ray's shard runner as a stand-in (the real one on a local cluster: tests/data_generation/
    test_ray_shards.py): it notes the address and writes two shards' token counts, or stops as
    SIGTERM makes it stop."""
    from speculators_vllm016.data_generation import ray_shards

    calls, train, _ = stand_ins
    calls["ray"] = []
    stopping = []

    def run(options, address, max_retries=2, verbose=False):
        if options.output.shard_index != 0:
            raise InvalidInputError(
                "--ray-address runs every shard itself; leave out --shard-index"
            )
        if stopping:
            raise ray_shards.StopRequested("SIGTERM: shards cancelled")
        calls["ray"].append((address, max_retries, options.output.num_shards))
        data = Path(options.output_dir)
        for shard in range(options.output.num_shards):
            counts = {i + shard: 100 - i for i in range(40)}
            save_token_counts(counts, data / f"token_freq/shard-{shard}-of-2.pth")
        return offline.DatagenSummary(str(data), 4, 4, 0, 40, 1.0, 0.5)

    monkeypatch.setattr(ray_shards, "run_shards_on_ray", run)
    return calls, train, stopping


def test_ray_address_runs_every_shard_then_maps_and_training_read_them_all(
    tmp_path, capsys, ray_stand_in
):
    calls, train, _ = ray_stand_in
    ray = ["--ray-address", "local", "--num-shards", "2", "--ray-max-retries", "1"]
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, *ray)), train) == 0
    assert calls["ray"] == [("local", 1, 2)] and calls["datagen"] == []
    assert len(calls["train"]) == 1
    # Where the shards ran is not part of the result: another address reuses the finished data.
    other = ["--ray-address", "10.0.0.1:6379", "--num-shards", "2"]
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, *other)), train) == 0
    assert "[1/3] datagen: done earlier" in capsys.readouterr().out
    assert calls["ray"] == [("local", 1, 2)]


def test_a_shard_index_with_ray_address_is_one_line_and_trains_nothing(tmp_path, capsys, stand_ins):
    """The real shard runner refuses it (before Ray is needed)."""
    calls, train, _ = stand_ins
    flags = ["--ray-address", "local", "--num-shards", "2", "--shard-index", "1"]
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, *flags)), train) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "leave out --shard-index" in err[0], err
    assert calls["train"] == [] and not (tmp_path / "data" / DATAGEN_DONE).exists()


def test_sigterm_during_ray_shards_exits_143_without_training(tmp_path, capsys, ray_stand_in):
    calls, train, stopping = ray_stand_in
    stopping.append(True)
    flags = ["--ray-address", "local", "--num-shards", "2"]
    assert run_gen_and_train(plan_from_argv(_argv(tmp_path, *flags)), train) == 143
    assert "stopped: SIGTERM" in capsys.readouterr().err
    assert calls["train"] == [] and not (tmp_path / "data" / DATAGEN_DONE).exists()
