"""A draft whose loss and metrics the test chooses, and a `Trainer` of it over ready-made rows.

The trainer's own guarantees (which epoch `best` names, how ranks' metrics combine, what a run
that trains nothing does, what it leaves of an earlier run) do not depend on the model: a
stand-in with one small weight makes those tests fast and their numbers exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader

from speculators_vllm016.train.trainer import Trainer, TrainerConfig

HIDDEN = 4  # width of the verifier's states the stand-in reads
FUSED = 3 * HIDDEN


@dataclass
class ScriptedOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


class ScriptedDraft(nn.Module):
    """Loss = a tiny function of its weight + `script(...)["loss"]`; metrics = `script(...)`.

    `script(training, call)` gets whether the model is in training mode and how many calls of
    that mode came before, and returns the metrics of this call; a `loss` entry is added to
    the loss itself. Satisfies the
    trainer's `FusesVerifierStates` (so a row without samples gets the empty row) and saves
    itself like a `PreTrainedModel`.
    """

    def __init__(self, script: Callable[[bool, int], dict[str, float]]) -> None:
        super().__init__()
        self.fc = nn.Linear(FUSED, HIDDEN, bias=False)
        self.target_hidden_size = HIDDEN
        self.script = script
        self.calls = {True: 0, False: 0}

    def forward(self, **inputs: Any) -> ScriptedOutput:
        values = self.script(self.training, self.calls[self.training])
        self.calls[self.training] += 1
        weight = (self.fc.weight.float() ** 2).sum() * 1e-3
        loss = weight + float(values.get("loss", 0.0))
        metrics = {name: torch.tensor(float(value)) for name, value in values.items()}
        metrics["loss"] = loss.detach()
        return ScriptedOutput(loss, metrics)

    def save_pretrained(self, folder: str | Path, state_dict: dict, **_: Any) -> None:
        folder = Path(folder)
        save_file(
            {k: v.contiguous() for k, v in state_dict.items()}, str(folder / "model.safetensors")
        )
        (folder / "config.json").write_text(json.dumps({"scripted": True}))


def packed_row(tokens: int = 8, loss_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """One packed row of `tokens` tokens (one sample), `loss_tokens` of them with a loss."""
    loss_tokens = tokens if loss_tokens is None else loss_tokens
    mask = torch.zeros(1, tokens, dtype=torch.long)
    mask[0, :loss_tokens] = 1
    return {
        "input_ids": torch.arange(tokens)[None],
        "hidden_states": torch.ones(1, tokens, FUSED),
        "verifier_last_hidden_states": torch.ones(1, tokens, HIDDEN),
        "loss_mask": mask,
        "position_ids": torch.arange(tokens)[None],
        "lengths": torch.tensor([tokens]),
        "skipped_samples": torch.tensor(0),
    }


def empty_row(skipped: int = 1) -> dict[str, torch.Tensor]:
    """A row all of whose samples were unusable (what the collate function gives then)."""
    return {"skipped_samples": torch.tensor(skipped)}


def rows_loader(rows: list[dict]) -> DataLoader:
    return DataLoader(rows, batch_size=None)  # rows as they are, in order


def scripted_trainer(
    save: Path,
    rows: list[dict],
    val_rows: list[dict] | None = None,
    script: Callable[[bool, int], dict[str, float]] = lambda training, call: {},
    **config: Any,
) -> Trainer:
    """A CPU `Trainer` of a `ScriptedDraft` (`config`: more `TrainerConfig` fields)."""
    settings = {
        "lr": 1e-3,
        "num_epochs": 1,
        "save_path": str(save),
        "device": "cpu",
        "show_progress": False,
        "handle_sigterm": False,
        "scheduler_type": "none",
        "resume_from_checkpoint": True,
        **config,
    }
    torch.manual_seed(0)
    model = ScriptedDraft(script)
    validation = rows_loader(val_rows) if val_rows else None
    return Trainer(model, TrainerConfig(**settings), rows_loader(rows), validation)
