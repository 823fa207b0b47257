"""The job's loaders and its closing: what `run_train_job` builds and how it ends.

`build_loaders` picks the loader of the data source (offline here; the online builders run in
tests/train/online's engine tests), registers what must be closed as soon as it is open, and
refuses a training split that makes no step. `_close_all` runs every closer; the failure already
on its way out stays the one reported."""

from __future__ import annotations

import logging

import pytest

from speculators_vllm016.cli.train import config_from_argv
from speculators_vllm016.train.jobs.job import _close_all
from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.train.jobs.loaders import build_loaders
from speculators_vllm016.train.jobs.rank_plan import RankPlan
from speculators_vllm016.train.jobs.setup import prepare
from speculators_vllm016.train.loading.sample_loader import SampleFileLoader
from tests.training_fixtures import train_args, write_dataset, write_vocab_maps


@pytest.fixture(scope="module")
def offline_job(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("loaders")
    data = write_dataset(tiny_llama, root / "data", [24, 40, 33, 57, 21, 30])
    write_vocab_maps(data, 512, root)
    argv = train_args(tiny_llama, data, root / "save", "--num-workers", "0")
    config, _ = config_from_argv(argv)
    return config, prepare(config)


def _ranks(world_size: int = 1) -> RankPlan:
    return RankPlan(0, world_size, 0, False, "cpu")


def test_offline_data_is_read_by_sample_file_loaders_that_the_job_closes(offline_job):
    config, setup = offline_job
    closers: list = []
    loaders = build_loaders(config, setup, _ranks(), closers)
    assert isinstance(loaders.train, SampleFileLoader)
    assert isinstance(loaders.validation, SampleFileLoader)
    assert loaders.online_stats is None
    assert closers == [loaders.train.close, loaders.validation.close]
    assert loaders.train.dataset.transform is not None  # training noise, validation none
    assert loaders.validation.dataset.transform is None


def test_a_training_split_that_makes_no_step_is_refused(offline_job):
    config, setup = offline_job
    with pytest.raises(TrainSetupError, match="training samples make no step for 64 processes"):
        build_loaders(config, setup, _ranks(world_size=64), [])


def test_every_closer_runs_and_the_first_failure_is_raised(caplog):
    ran: list[str] = []

    def failing(name: str):
        def close() -> None:
            ran.append(name)
            raise OSError(f"{name} failed")

        return close

    with pytest.raises(OSError, match="first failed"), caplog.at_level(logging.ERROR):
        _close_all([failing("first"), failing("second"), lambda: ran.append("third")], None)
    assert ran == ["first", "second", "third"]
    assert "while closing: OSError: second failed" in caplog.text


def test_a_failure_on_its_way_out_stays_the_one_reported(caplog):
    ran: list[str] = []

    def failing() -> None:
        ran.append("closer")
        raise OSError("closing failed")

    with caplog.at_level(logging.ERROR):
        _close_all([failing, lambda: ran.append("after")], RuntimeError("training failed"))
    assert ran == ["closer", "after"]
    assert "while closing: OSError: closing failed" in caplog.text
