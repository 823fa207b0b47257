"""`TrainerConfig`: how the trainer trains, one documented field per knob (0.3.0's fields first).

A training job builds it from its `TrainJobConfig` in one place, `TrainerConfig.from_job_config`
(each setting is defined once, in the job config's sections); 0.3.0's callers and the benchmarks
build it field by field. The trainer reads nothing else. Imported as `speculators_vllm016.train.trainer.TrainerConfig` too
(0.3.0's path).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from speculators_vllm016.train.draft_contract import DraftCallOptions
from speculators_vllm016.train.jobs.job_config import CHECKPOINT_DTYPES

if TYPE_CHECKING:
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig

__all__ = ["TrainerConfig"]


@dataclass(frozen=True)
class TrainerConfig:
    """How to train. The first twelve fields are 0.3.0's `TrainerConfig`, in its order."""

    lr: float
    """AdamW's learning rate (the peak, after warm-up)."""
    num_epochs: int
    """Epochs to train; a resumed run counts the epochs already done."""
    save_path: str
    """The checkpoint folder: `<epoch>/`, `<epoch>-step<global>/`, `best`, `metrics.jsonl`."""
    resume_from_checkpoint: bool = False
    """Continue from the newest complete checkpoint in `save_path`. Off, a run from scratch
    replaces the checkpoints there when it finishes its first epoch (or its last step, if
    sooner), and writes no checkpoint before that: stopped earlier, it leaves them as they were."""
    is_distributed: bool = False
    """Set by `maybe_setup_distributed()` under torchrun."""
    local_rank: int = 0
    """This process's rank on its host (its GPU), set by `maybe_setup_distributed()`."""
    train_call_kwargs: DraftCallOptions = field(default_factory=DraftCallOptions)
    """Options of the model's training call (`ttt_steps`, `ttt_step_loss_decay`,
    `use_off_policy_tokens`); 0.3.0's dict of the same names is accepted and converted."""
    val_call_kwargs: DraftCallOptions = field(default_factory=DraftCallOptions)
    """Options of the model's validation call, as `train_call_kwargs`."""
    scheduler_type: Literal["linear", "cosine", "none"] = "linear"
    """Learning-rate decay after the warm-up, or none (constant `lr`)."""
    scheduler_warmup_steps: int | None = None
    """Warm-up steps; None: 1% of the run's steps (epochs x steps per epoch, capped at
    `max_steps`: 0.3.0's value without the cap)."""
    scheduler_total_steps: int | None = None
    """Steps the schedule spans; None: the run's steps."""
    scheduler_num_cosine_cycles: float = 0.5
    """Cosine cycles over the schedule (0.5: one decay from `lr` to 0)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm before each step."""
    seed: int = 0
    """Seeds the sampler's shuffles and the noise (set on the loaders by the caller); recorded
    in checkpoints so a resume with another seed warns."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """"fp32", or "bf16" (bf16 autocast over fp32 master weights); "auto" is bf16 on CUDA and
    fp32 on CPUs."""
    parallel: Literal["fsdp", "ddp"] = "fsdp"
    """Under torchrun: "fsdp" (FSDP2, shards weights and optimizer state) or "ddp"."""
    device: str | None = None
    """Where to train ("cpu", "cuda"); None: this rank's GPU, else the CPU."""
    checkpoint_freq: float | None = None
    """Also checkpoint every this fraction of an epoch (0.25: four times); None: epoch ends only."""
    max_steps: int | None = None
    """Stop (with a checkpoint) after this many optimizer steps in all."""
    checkpoint_dtype: torch.dtype = torch.bfloat16
    """Dtype of the served `model.safetensors` (fp32 master weights are kept beside it)."""
    optimizer_state_dtype: torch.dtype | None = None
    """None keeps the optimizer state as it is (fp32); bf16 is 0.3.0's (its defect D2)."""
    keep_mid_epoch_checkpoints: int = 1
    """How many mid-epoch checkpoints after the newest epoch one to keep (older ones are
    deleted; epoch ones stay). The checkpoint just written is never deleted, so 0 keeps just
    that one, like 1."""
    keep_last_checkpoints: int | None = None
    """How many checkpoints of any kind to keep (older ones are deleted after each save; the
    best one by validation tau_sim stays besides); None keeps them all."""
    background_checkpoints: bool = True
    """Write checkpoints in a background thread: the step loop only waits for a snapshot of
    the weights and optimizer state (`checkpointing.background_writer`)."""
    fsdp_bf16_params: bool = False
    """Under FSDP2, gather bf16 copies of the weights instead of the fp32 masters (half the
    traffic, less memory; norms then scale by bf16 weights)."""
    deterministic: bool = False
    """Compile the draft's blocks so that a GPU run's numbers do not depend on the shapes
    compiled before (`use_reproducible_compilation`): a resumed run then ends with the
    uninterrupted run's weights bit for bit, as CPU runs always do. Slower (7% a step on an
    H200 at 8B-draft shapes, one measurement)."""
    show_progress: bool = True
    """A progress bar per epoch and for validation (rank 0)."""
    start: str = "starting from scratch"
    """What a run with no checkpoint to resume starts from, for its log line (a
    `--from-pretrained` job names the draft it fine-tunes)."""
    handle_sigterm: bool = True
    """Stop on SIGTERM or a first Ctrl-C after the current step, with a checkpoint
    (`graceful_shutdown`); off, the signals keep their default handlers."""

    def __post_init__(self) -> None:
        for name in ("train_call_kwargs", "val_call_kwargs"):
            object.__setattr__(self, name, DraftCallOptions.coerce(getattr(self, name)))

    @classmethod
    def from_job_config(
        cls,
        config: TrainJobConfig,
        *,
        save_path: str,
        is_distributed: bool,
        local_rank: int,
        device: str | None,
    ) -> TrainerConfig:
        """The trainer's settings of a job: the job config's, plus where this process trains
        (known once its process group is joined)."""
        training, runtime, checkpoint = config.training, config.runtime, config.checkpoint
        call = DraftCallOptions(
            ttt_steps=config.model.ttt_steps,
            ttt_step_loss_decay=config.model.ttt_step_loss_decay,
            use_off_policy_tokens=training.teacher_forcing,
        )
        return cls(
            lr=training.lr,
            num_epochs=training.epochs,
            save_path=save_path,
            resume_from_checkpoint=not checkpoint.no_resume_from_checkpoint,
            is_distributed=is_distributed,
            local_rank=local_rank,
            train_call_kwargs=call,
            val_call_kwargs=call,
            scheduler_type=training.scheduler_type,
            scheduler_warmup_steps=training.scheduler_warmup_steps,
            scheduler_total_steps=training.scheduler_total_steps,
            scheduler_num_cosine_cycles=training.scheduler_num_cosine_cycles,
            weight_decay=training.weight_decay,
            max_grad_norm=training.max_grad_norm,
            seed=training.seed,
            precision=runtime.precision,
            parallel=runtime.parallel,
            device=device,
            checkpoint_freq=checkpoint.checkpoint_freq,
            max_steps=training.max_steps,
            checkpoint_dtype=getattr(torch, CHECKPOINT_DTYPES[checkpoint.checkpoint_dtype]),
            optimizer_state_dtype=torch.bfloat16 if config.legacy.bf16_optimizer_state else None,
            keep_mid_epoch_checkpoints=checkpoint.keep_mid_epoch_checkpoints,
            keep_last_checkpoints=checkpoint.keep_last,
            fsdp_bf16_params=runtime.fsdp_bf16_params,
            deterministic=runtime.deterministic,
            show_progress=not config.logging.no_progress,
            start=(
                f"starting from the weights of --from-pretrained {config.model.from_pretrained}"
                if config.model.from_pretrained
                else "starting from scratch"
            ),
        )

    def _replace(self, **changes: Any) -> TrainerConfig:
        """NamedTuple-style copy with changes (0.3.0's config was a NamedTuple)."""
        return dataclasses.replace(self, **changes)
