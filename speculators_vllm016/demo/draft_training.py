"""A demo draft's training: where its files go, its training job, and what the summary reports of it.

Both demo drafts (on the shipped and on the regenerated conversations) train with the same
`TrainJobConfig` built here; only their folders (`DraftLane`) differ.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculators_vllm016.utils.atomic_files import atomic_write, give_usual_modes, replace_folder

if TYPE_CHECKING:
    from speculators_vllm016.demo.options import DemoOptions
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig

__all__ = [
    "DraftLane",
    "plot_training_curves",
    "read_training_metrics",
    "save_initial_draft",
    "train_config",
    "training_throughput",
]


@dataclass(frozen=True)
class DraftLane:
    """Where one trained draft's hidden states, vocabulary maps and checkpoints go."""

    folder: Path

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def vocab(self) -> Path:
        return self.folder / "vocab"

    @property
    def checkpoints(self) -> Path:
        return self.folder / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.folder / "logs"

    @property
    def curves(self) -> Path:
        return self.folder / "training_curves.png"


def train_config(
    options: DemoOptions,
    lane: DraftLane,
    target: Path,
) -> TrainJobConfig:
    """A draft's training job: its lane's folders, the demo's options, the CPU in this process."""
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig
    from speculators_vllm016.train.jobs.job_sections import (
        CheckpointConfig,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        RuntimeConfig,
        TrainingConfig,
        VocabConfig,
    )
    from speculators_vllm016.train.vocab_maps import D2T_FILE, T2D_FILE

    return TrainJobConfig(
        model=ModelConfig(verifier_name_or_path=str(target), sliding_window=options.sliding_window),
        data=DataConfig(data_path=str(lane.data)),
        vocab=VocabConfig(d2t_path=str(lane.vocab / D2T_FILE), t2d_path=str(lane.vocab / T2D_FILE)),
        checkpoint=CheckpointConfig(save_path=str(lane.checkpoints)),
        training=TrainingConfig(
            epochs=options.epochs,
            lr=options.lr,
            total_seq_len=options.total_seq_len,
            seed=options.seed,
        ),
        runtime=RuntimeConfig(num_workers=0, device="cpu"),
        logging=LoggingConfig(log_dir=str(lane.logs), no_progress=not options.show_progress),
    )


def save_initial_draft(config: TrainJobConfig, output: Path) -> None:
    """The draft exactly as training starts from it (the trainer's construction and seed)."""
    import torch

    from speculators_vllm016.train.checkpointing.checkpoint_files import convert_float_dtype
    from speculators_vllm016.train.jobs.draft_build import build_model
    from speculators_vllm016.train.jobs.setup import prepare

    model = build_model(config, prepare(config))
    temporary = output.with_name(f".{output.name}.partial")
    shutil.rmtree(temporary, ignore_errors=True)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    model.save_pretrained(
        temporary, state_dict=convert_float_dtype(weights, torch.bfloat16), safe_serialization=True
    )
    give_usual_modes(temporary)
    replace_folder(temporary, output)


def read_training_metrics(path: Path) -> list[dict]:
    """The train lines of the trainer's metrics.jsonl: `{"step", "loss", "full_acc_0", "tokens"}`."""
    from speculators_vllm016.train.metrics_log import read_train_steps

    return read_train_steps(path)


def training_throughput(metrics: list[dict], call_seconds: float) -> tuple[int, float]:
    """All trained tokens, and tokens per second of the steps that trained them.

    A resumed training call logs only its own steps, but metrics.jsonl holds every step of the
    run (the interrupted call's too): the rate divides the tokens by the steps' own
    `step_seconds`, never by the time of the last call. Lines without `step_seconds` (a trainer
    that does not log it) fall back to `call_seconds`.
    """
    tokens = int(sum(m.get("tokens", 0) for m in metrics))
    timed = [m for m in metrics if isinstance(m.get("step_seconds"), (int, float))]
    if metrics and len(timed) == len(metrics):
        seconds = sum(m["step_seconds"] for m in timed)
    else:
        seconds = call_seconds
    return tokens, tokens / seconds if seconds > 0 else 0.0


def plot_training_curves(metrics: list[dict], path: Path) -> None:
    """A PNG of the draft's training loss and first-position accuracy per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    figure, (loss_axes, acc_axes) = plt.subplots(1, 2, figsize=(9.6, 3.6), dpi=100)
    loss_axes.plot(steps, [m.get("loss") for m in metrics], color="tab:red")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("training loss")
    acc_axes.plot(steps, [m.get("full_acc_0") for m in metrics], color="tab:blue")
    acc_axes.set_xlabel("step")
    acc_axes.set_ylabel("full_acc_0 (first draft token)")
    acc_axes.set_ylim(0.0, 1.0)
    for axes in (loss_axes, acc_axes):
        axes.grid(alpha=0.3)
    figure.suptitle("Draft training (speculators demo)")
    figure.tight_layout()
    try:
        atomic_write(path, lambda handle: figure.savefig(handle, format="png"))
    finally:
        plt.close(figure)
