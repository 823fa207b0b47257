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
from speculators_vllm016.train.jobs.job_sections import CHECKPOINT_DTYPES

if TYPE_CHECKING:
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig

__all__ = ["TrainerConfig"]


@dataclass(frozen=True)
class TrainerConfig:
    """How to train. The first twelve fields are 0.3.0's `TrainerConfig`, in its order.

    A field a job sets from one of its settings names it (`metadata["job"]`, "section.field" of
    `TrainJobConfig`): that field's docstring, the flag's `--help`, is its one description
    (`TrainerConfig.field_doc`); the docstring here names the flag only."""

    lr: float = field(metadata={"job": "training.lr"})
    """`--lr`."""
    num_epochs: int = field(metadata={"job": "training.epochs"})
    """`--epochs`."""
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
    scheduler_type: Literal["linear", "cosine", "none"] = field(
        default="linear", metadata={"job": "training.scheduler_type"}
    )
    """`--scheduler-type`."""
    scheduler_warmup_steps: int | None = field(
        default=None, metadata={"job": "training.scheduler_warmup_steps"}
    )
    """`--scheduler-warmup-steps`."""
    scheduler_total_steps: int | None = field(
        default=None, metadata={"job": "training.scheduler_total_steps"}
    )
    """`--scheduler-total-steps`."""
    scheduler_num_cosine_cycles: float = field(
        default=0.5, metadata={"job": "training.scheduler_num_cosine_cycles"}
    )
    """`--scheduler-num-cosine-cycles`."""
    weight_decay: float = field(default=0.01, metadata={"job": "training.weight_decay"})
    """`--weight-decay`."""
    max_grad_norm: float = field(default=1.0, metadata={"job": "training.max_grad_norm"})
    """`--max-grad-norm`."""
    seed: int = field(default=0, metadata={"job": "training.seed"})
    """`--seed` (set on the loaders by the caller; recorded in checkpoints: a resume with
    another seed warns)."""
    precision: Literal["auto", "fp32", "bf16"] = field(
        default="auto", metadata={"job": "runtime.precision"}
    )
    """`--precision`."""
    parallel: Literal["fsdp", "ddp"] = field(default="fsdp", metadata={"job": "runtime.parallel"})
    """`--parallel`."""
    device: str | None = None
    """Where to train ("cpu", "cuda"); None: this rank's GPU, else the CPU."""
    checkpoint_freq: float | None = field(
        default=None, metadata={"job": "checkpoint.checkpoint_freq"}
    )
    """`--checkpoint-freq`."""
    max_steps: int | None = field(default=None, metadata={"job": "training.max_steps"})
    """`--max-steps`."""
    checkpoint_dtype: torch.dtype = torch.bfloat16
    """Dtype of the served `model.safetensors` (fp32 master weights are kept beside it)."""
    optimizer_state_dtype: torch.dtype | None = None
    """None keeps the optimizer state as it is (fp32); bf16 is 0.3.0's (its defect D2)."""
    keep_mid_epoch_checkpoints: int = field(
        default=1, metadata={"job": "checkpoint.keep_mid_epoch_checkpoints"}
    )
    """`--keep-mid-epoch-checkpoints`."""
    keep_last_checkpoints: int | None = field(
        default=None, metadata={"job": "checkpoint.keep_last"}
    )
    """`--keep-last`."""
    background_checkpoints: bool = field(
        default=True, metadata={"job": "checkpoint.background_checkpoints"}
    )
    """`--background-checkpoints` (`checkpointing.background_writer`)."""
    fsdp_bf16_params: bool = field(default=False, metadata={"job": "runtime.fsdp_bf16_params"})
    """`--fsdp-bf16-params`."""
    deterministic: bool = field(default=False, metadata={"job": "runtime.deterministic"})
    """`--deterministic` (`use_reproducible_compilation`)."""
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
        training, checkpoint = config.training, config.checkpoint
        call = DraftCallOptions(
            ttt_steps=config.model.ttt_steps,
            ttt_step_loss_decay=config.model.ttt_step_loss_decay,
            use_off_policy_tokens=training.teacher_forcing,
        )
        return cls(
            **{item.name: _job_value(config, item.metadata["job"]) for item in _FROM_JOB},
            save_path=save_path,
            resume_from_checkpoint=not checkpoint.no_resume_from_checkpoint,
            is_distributed=is_distributed,
            local_rank=local_rank,
            train_call_kwargs=call,
            val_call_kwargs=call,
            device=device,
            checkpoint_dtype=getattr(torch, CHECKPOINT_DTYPES[checkpoint.checkpoint_dtype]),
            optimizer_state_dtype=torch.bfloat16 if config.legacy.bf16_optimizer_state else None,
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

    @staticmethod
    def field_doc(name: str) -> str:
        """What the field `name` means: for a setting of the job config (metadata `job`), that
        field's docstring (the flag's help: the one description of it), else its own."""
        from speculators_vllm016.utils.field_docs import field_docs

        item = next(item for item in dataclasses.fields(TrainerConfig) if item.name == name)
        job = item.metadata.get("job")
        if job is None:
            return field_docs(TrainerConfig).get(name, "")
        from speculators_vllm016.train.jobs.job_config import TrainJobConfig

        section, key = job.split(".")
        return field_docs(type(getattr(TrainJobConfig(), section))).get(key, "")


_FROM_JOB = tuple(item for item in dataclasses.fields(TrainerConfig) if "job" in item.metadata)
"""The fields a job sets straight from its config: `metadata["job"]` is "section.field"."""


def _job_value(config: TrainJobConfig, path: str) -> Any:
    section, key = path.split(".")
    return getattr(getattr(config, section), key)
