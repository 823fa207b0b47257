"""`--train-devices` parsing (pure logic) and the engine's CUDA_VISIBLE_DEVICES window."""

from __future__ import annotations

import os

import pytest

from speculators_vllm016.train.jobs.devices import (
    TrainDevices,
    TrainDevicesError,
    engine_visible_devices,
    parse_train_devices,
)

EIGHT = [str(index) for index in range(8)]


def test_cpu_trains_on_the_cpu_and_leaves_the_engine_alone():
    assert parse_train_devices("cpu", visible=[]) == TrainDevices(
        trainer=("cpu",), engine_visible=None
    )
    assert parse_train_devices("cpu", visible=[], local_processes=2).for_rank(1) == "cpu"


def test_one_gpu_for_the_trainer_the_rest_for_the_engine():
    devices = parse_train_devices("cuda:7", visible=EIGHT)
    assert devices.trainer == ("cuda:7",) and devices.engine_visible == "0,1,2,3,4,5,6"
    assert devices.for_rank(0) == "cuda:7"


def test_one_gpu_per_training_process_and_the_trainers_own_numbering():
    visible = ["2", "3", "4", "5"]  # CUDA_VISIBLE_DEVICES=2,3,4,5: cuda:0 is physical GPU 2
    devices = parse_train_devices(
        "cuda:2, cuda:3", visible=visible, local_processes=2, engine_gpus_needed=2
    )
    assert devices.trainer == ("cuda:2", "cuda:3") and devices.engine_visible == "2,3"
    assert [devices.for_rank(rank) for rank in (0, 1)] == ["cuda:2", "cuda:3"]


@pytest.mark.parametrize(
    ("text", "visible", "processes", "needed", "says"),
    [
        ("", EIGHT, 1, 1, "empty"),
        ("cuda:1,", EIGHT, 1, 1, "empty"),
        ("gpu7", EIGHT, 1, 1, "'gpu7' is not a device"),
        ("cuda", EIGHT, 1, 1, "'cuda' is not a device"),
        ("cuda:-1", EIGHT, 1, 1, "'cuda:-1' is not a device"),
        ("cpu,cuda:0", EIGHT, 1, 1, "mixes cpu"),
        ("cuda:1,cuda:1", EIGHT, 2, 1, "names a GPU twice"),
        ("cuda:0", [], 1, 1, "no CUDA GPU is visible"),
        ("cuda:8", EIGHT, 1, 1, "cuda:8 does not exist (8 GPUs visible"),
        ("cuda:6,cuda:7", EIGHT, 1, 1, "2 GPUs for 1 training processes"),
        ("cuda:0", ["0"], 1, 1, "leaves 0 of 1 GPUs"),
        ("cuda:0,cuda:1", ["0", "1", "2"], 2, 2, "leaves 1 of 3 GPUs"),
    ],
)
def test_bad_values_name_the_flag_and_the_problem(text, visible, processes, needed, says):
    with pytest.raises(TrainDevicesError) as raised:
        parse_train_devices(
            text, visible=visible, local_processes=processes, engine_gpus_needed=needed
        )
    message = str(raised.value)
    assert "--train-devices" in message and says in message and "\n" not in message


def test_the_engine_window_sets_and_restores_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with engine_visible_devices("0,1"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError), engine_visible_devices("3"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
        raise RuntimeError
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with engine_visible_devices(None):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_torchruns_variables_are_hidden_while_the_engine_starts(monkeypatch):
    from speculators_vllm016.train.jobs.devices import launcher_variables_hidden

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with launcher_variables_hidden():
        assert not {"TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT", "WORLD_SIZE"} & set(os.environ)
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True" and os.environ["WORLD_SIZE"] == "2"
