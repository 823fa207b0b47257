"""What the trainer promises about its results, on a draft whose metrics the test chooses:
`best` names the epoch with the highest validation tau_sim; several ranks' metrics are logged
as means (tokens as a sum); a run or an epoch that trains no token fails; the logged wait for
data is the loader's alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.train.scripted_draft import (
    ScriptedDraft,
    empty_row,
    packed_row,
    rows_loader,
    scripted_trainer,
)


def test_best_names_the_epoch_with_the_highest_validation_tau_sim_not_the_newest(tmp_path):
    accuracy = {0: 0.2, 1: 0.6, 2: 0.4}  # validation of epoch e: tau_sim = 1 + accuracy[e]

    def script(training: bool, call: int) -> dict[str, float]:
        return {"full_acc_0": 0.5} if training else {"full_acc_0": accuracy[call]}

    save = tmp_path / "ckpt"
    trainer = scripted_trainer(
        save, [packed_row(), packed_row()], [packed_row()], script, num_epochs=3
    )
    state = trainer.run_training()
    assert os.readlink(save / "best") == "1", "best must stay on the epoch of tau_sim 1.6"
    assert state.best_checkpoint == "1" and abs(state.best_val_tau_sim - 1.6) < 1e-6
    assert {p.name for p in save.iterdir() if p.name.isdigit()} == {"0", "1", "2"}


def _log_one_step_on_two_ranks(rank: int, port: int, save: str, out: str) -> None:
    """Rank r's row holds 8 (r + 1) tokens, its loss is (r + 1) and its accuracy 0.2 (r + 1);
    rank 0 saves what the trainer logged."""
    import gc
    import logging

    import torch

    from speculators_vllm016.train.logger import METRICS_LOGGER
    from tests.training_fixtures import gloo_group

    records: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.msg)

    metrics = logging.getLogger(METRICS_LOGGER)
    metrics.setLevel(logging.INFO)
    metrics.addHandler(Keep())
    torch.set_num_threads(1)

    def script(training: bool, call: int) -> dict[str, float]:
        return {"loss": rank + 1.0, "full_acc_0": 0.2 * (rank + 1)}

    with gloo_group(rank, port):
        trainer = scripted_trainer(
            Path(save),
            [packed_row(8 * (rank + 1))],
            None,
            script,
            is_distributed=True,
            local_rank=rank,
            parallel="ddp",
        )
        trainer.run_training()
        if rank == 0:
            torch.save({"records": records}, out)
        del trainer  # DDP's reducer lets go of the group before the group goes
        gc.collect()


@pytest.mark.slow
def test_metrics_of_several_ranks_are_logged_as_means_and_tokens_as_a_sum(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from tests.training_fixtures import free_port

    out = tmp_path / "logged.pt"
    mp.spawn(
        _log_one_step_on_two_ranks,
        args=(free_port(), str(tmp_path / "ckpt"), str(out)),
        nprocs=2,
        join=True,
    )
    logged = torch.load(out)
    steps = [record["train"] for record in logged["records"] if "train" in record]
    assert len(steps) == 1
    step = steps[0]
    assert step["tokens"] == 24, "tokens are the sum over ranks (8 + 16)"
    assert abs(step["full_acc_0"] - 0.3) < 1e-6, "accuracy is the mean over ranks, not the sum"
    # Both ranks start from the same weight (seed 0), so the weight term of the loss and the
    # gradient are the same on both: the mean keeps them, a sum would double them.
    torch.manual_seed(0)
    weight = ScriptedDraft(lambda training, call: {}).fc.weight.detach()
    term = float((weight**2).sum() * 1e-3)
    assert abs(step["loss"] - (term + 1.5)) < 1e-5, "loss is the mean over ranks, not the sum"
    gradient_norm = float((2e-3 * weight).norm())
    assert abs(step["grad_norm"] - gradient_norm) < 1e-6, "grad_norm is the mean, not the sum"


@pytest.mark.parametrize("rows", ["unusable samples", "no token with a loss"])
def test_an_epoch_that_trains_no_token_fails_in_one_line_and_saves_nothing(tmp_path, rows):
    from speculators_vllm016.train.errors import NothingTrained, TrainingError

    batches = (
        [empty_row(), empty_row(2)]
        if rows == "unusable samples"
        else [packed_row(1, loss_tokens=0), packed_row(1, loss_tokens=0)]
    )
    save = tmp_path / "ckpt"
    trainer = scripted_trainer(save, batches, [packed_row()])
    with pytest.raises(NothingTrained, match="epoch 0 trained no token") as raised:
        trainer.run_training()
    assert isinstance(raised.value, TrainingError) and "\n" not in str(raised.value)
    assert not list(save.glob("[0-9]*")), "an untrained checkpoint was saved"


def test_a_later_epoch_that_trains_no_token_fails_too(tmp_path):
    from speculators_vllm016.train.errors import NothingTrained

    class Rows(list):
        """Epoch 0's rows hold tokens, epoch 1's none (the dataset learns its epoch)."""

        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __getitem__(self, index):
            return packed_row() if self.epoch == 0 else empty_row()

    trainer = scripted_trainer(tmp_path / "ckpt", [], None, num_epochs=2)
    trainer.train_loader = rows_loader(Rows([None, None]))
    with pytest.raises(NothingTrained, match="epoch 1 trained no token"):
        trainer.run_training()
    assert (tmp_path / "ckpt" / "0").is_dir() and not (tmp_path / "ckpt" / "1").exists()


def test_the_logged_data_wait_is_the_loaders_not_the_steps(tmp_path):
    # A loader that takes 0.05 s a row and a step that takes 0.4 s: data_wait_seconds must be
    # the loader's share of step_seconds, not the step (no absolute time is asserted above the
    # sleeps' own lower bounds: only how the two figures compare, with wide margins).
    import logging
    import time

    from torch.utils.data import Dataset

    from speculators_vllm016.train.logger import METRICS_LOGGER

    loader_sleep, step_sleep = 0.05, 0.4

    class SlowRows(Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> dict:
            time.sleep(loader_sleep)
            return packed_row()

    def script(training: bool, call: int) -> dict[str, float]:
        time.sleep(step_sleep)
        return {}

    records: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.msg)

    metrics = logging.getLogger(METRICS_LOGGER)
    keep, level = Keep(), metrics.level
    metrics.setLevel(logging.INFO)
    metrics.addHandler(keep)
    try:
        trainer = scripted_trainer(tmp_path / "ckpt", [], None, script)
        trainer.train_loader = rows_loader(SlowRows())
        trainer.run_training()
    finally:
        metrics.removeHandler(keep)
        metrics.setLevel(level)
    steps = [record["train"] for record in records if "train" in record]
    assert len(steps) == 3
    for step in steps:
        assert step["data_wait_seconds"] >= loader_sleep  # a sleep lasts at least its time
        assert step["step_seconds"] >= step_sleep + loader_sleep
        # The step's sleep is 8x the loader's: a wait that counted the step would exceed half.
        assert step["data_wait_seconds"] < 0.5 * step["step_seconds"], step
