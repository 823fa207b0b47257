"""What the trainer promises about its results, on a draft whose metrics the test chooses:
`best` names the epoch with the highest validation tau_sim; several ranks' metrics are logged
as means (tokens as a sum); a run or an epoch that trains no token fails."""

from __future__ import annotations

import os
from pathlib import Path

from tests.train.scripted_draft import packed_row, scripted_trainer


def test_best_names_the_epoch_with_the_highest_validation_tau_sim_not_the_newest(tmp_path):
    accuracy = {0: 0.2, 1: 0.6, 2: 0.4}  # validation of epoch e: tau_sim = 1 + accuracy[e]

    def script(training: bool, call: int) -> dict[str, float]:
        return {"full_acc_0": 0.5} if training else {"full_acc_0": accuracy[call]}

    save = tmp_path / "ckpt"
    trainer = scripted_trainer(save, [packed_row(), packed_row()], [packed_row()], script,
                               num_epochs=3)
    state = trainer.run_training()
    assert os.readlink(save / "best") == "1", "best must stay on the epoch of tau_sim 1.6"
    assert state.best_checkpoint == "1" and abs(state.best_val_tau_sim - 1.6) < 1e-6
    assert {p.name for p in save.iterdir() if p.name.isdigit()} == {"0", "1", "2"}
