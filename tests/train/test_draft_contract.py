"""The trainer's contract with the draft: typed call options that still read as 0.3.0's dict."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.train.draft_contract import (
    DraftCallOptions,
    FusesVerifierStates,
    loss_and_metrics,
)
from speculators_vllm016.train.loading.device_rows import StepRow, empty_row, to_step_row
from speculators_vllm016.train.trainer import TrainerConfig


def test_call_options_are_typed_and_spread_like_the_030_dict():
    options = DraftCallOptions(ttt_steps=3, use_off_policy_tokens=True)
    assert dict(options) == {"ttt_steps": 3, "use_off_policy_tokens": True}
    assert DraftCallOptions() == {} and DraftCallOptions() == {}
    assert (lambda **kwargs: kwargs)(**options) == {"ttt_steps": 3, "use_off_policy_tokens": True}
    config = TrainerConfig(lr=1.0, num_epochs=1, save_path="x", train_call_kwargs={"ttt_steps": 2})
    assert isinstance(config.train_call_kwargs, DraftCallOptions)
    assert config.train_call_kwargs.ttt_steps == 2 and config._replace(
        lr=2.0
    ).train_call_kwargs == {"ttt_steps": 2}
    with pytest.raises(TypeError, match="unknown draft call options"):
        DraftCallOptions.coerce({"ttt_step": 2})


def test_outputs_typed_or_030_tuples():
    class Output:
        loss = torch.tensor(1.0)
        metrics = {"loss": torch.tensor(1.0)}

    assert loss_and_metrics(Output())[1] == Output.metrics
    loss, metrics = loss_and_metrics((None, torch.tensor(2.0), None))
    assert float(loss) == 2.0 and metrics == {}
    with pytest.raises(ValueError, match="no loss"):
        loss_and_metrics((None, None, {}))


def test_a_row_without_samples_becomes_the_drafts_empty_row():
    class Draft(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.target_hidden_size = 8
            self.fc = torch.nn.Linear(24, 8)

    draft = Draft()
    assert isinstance(draft, FusesVerifierStates)
    row = to_step_row({"skipped_samples": torch.tensor(3)}, torch.device("cpu"), draft)
    assert isinstance(row, StepRow) and not row.has_samples and int(row.skipped_samples) == 3
    assert row.inputs["hidden_states"].shape == (1, 1, 24)
    assert row.inputs["verifier_last_hidden_states"].shape == (1, 1, 8)
    with pytest.raises(ValueError, match="unusable"):
        empty_row(torch.nn.Linear(2, 2), torch.device("cpu"))
