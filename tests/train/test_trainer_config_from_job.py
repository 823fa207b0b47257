"""`TrainerConfig.from_job_config`: the one place a job's settings become the trainer's.

Every trainer setting comes from the job config (or from where the process trains), none keeps
its default by being forgotten: the job below sets each one to a value other than the default.
0.3.0's field-by-field `TrainerConfig(...)` is tested with the trainer."""

from __future__ import annotations

import dataclasses

import torch

from speculators_vllm016.train.draft_contract import DraftCallOptions
from speculators_vllm016.train.jobs.job_config import TrainJobConfig
from speculators_vllm016.train.trainer_config import TrainerConfig

# Set by the trainer's own callers only (a test's signal handling), never by a job.
NOT_FROM_THE_JOB = {"handle_sigterm"}

JOB = {
    "model": {"ttt_steps": 5, "ttt_step_loss_decay": 0.8},
    "training": {
        "lr": 3e-4,
        "epochs": 7,
        "teacher_forcing": False,
        "scheduler_type": "cosine",
        "scheduler_warmup_steps": 11,
        "scheduler_total_steps": 900,
        "scheduler_num_cosine_cycles": 1.5,
        "weight_decay": 0.05,
        "max_grad_norm": 0.5,
        "seed": 42,
        "max_steps": 600,
    },
    "checkpoint": {
        "no_resume_from_checkpoint": True,
        "checkpoint_freq": 0.25,
        "checkpoint_dtype": "fp16",
        "keep_mid_epoch_checkpoints": 3,
        "keep_last": 4,
        "background_checkpoints": False,
    },
    "runtime": {
        "precision": "bf16",
        "parallel": "ddp",
        "fsdp_bf16_params": True,
        "deterministic": True,
    },
    "legacy": {"bf16_optimizer_state": True},
    "logging": {"no_progress": True},
}


def _from_job(values: dict) -> TrainerConfig:
    return TrainerConfig.from_job_config(
        TrainJobConfig.from_dict(values),
        save_path="/runs/draft",
        is_distributed=True,
        local_rank=3,
        device="cuda:3",
    )


def test_every_job_setting_reaches_the_trainer():
    call = DraftCallOptions(ttt_steps=5, ttt_step_loss_decay=0.8, use_off_policy_tokens=False)
    assert _from_job(JOB) == TrainerConfig(
        lr=3e-4,
        num_epochs=7,
        save_path="/runs/draft",
        resume_from_checkpoint=False,
        is_distributed=True,
        local_rank=3,
        train_call_kwargs=call,
        val_call_kwargs=call,
        scheduler_type="cosine",
        scheduler_warmup_steps=11,
        scheduler_total_steps=900,
        scheduler_num_cosine_cycles=1.5,
        weight_decay=0.05,
        max_grad_norm=0.5,
        seed=42,
        precision="bf16",
        parallel="ddp",
        device="cuda:3",
        checkpoint_freq=0.25,
        max_steps=600,
        checkpoint_dtype=torch.float16,
        optimizer_state_dtype=torch.bfloat16,
        keep_mid_epoch_checkpoints=3,
        keep_last_checkpoints=4,
        background_checkpoints=False,
        fsdp_bf16_params=True,
        deterministic=True,
        show_progress=False,
    )


def test_no_trainer_setting_is_left_at_its_default():
    """A new `TrainerConfig` field that `from_job_config` does not set fails here."""
    # The trainer's default is 0.3.0's (no resume); a job resumes unless told not to.
    # A fine-tuning job names its draft in the start line (`start`).
    resuming = {
        **JOB,
        "model": {**JOB["model"], "from_pretrained": "drafts/earlier"},
        "checkpoint": {**JOB["checkpoint"], "no_resume_from_checkpoint": False},
    }
    built = _from_job(resuming)
    defaults = TrainerConfig(lr=0.0, num_epochs=0, save_path="")
    same = [
        field.name
        for field in dataclasses.fields(TrainerConfig)
        if field.name not in NOT_FROM_THE_JOB
        and getattr(built, field.name) == getattr(defaults, field.name)
    ]
    assert same == []


def test_a_default_job_trains_as_the_job_config_documents():
    built = _from_job({})
    job = TrainJobConfig()
    assert (built.lr, built.num_epochs, built.seed) == (
        job.training.lr,
        job.training.epochs,
        job.training.seed,
    )
    assert built.resume_from_checkpoint and built.show_progress and built.background_checkpoints
    assert built.checkpoint_dtype == torch.bfloat16 and built.optimizer_state_dtype is None
    assert built.train_call_kwargs == DraftCallOptions(
        ttt_steps=job.model.ttt_steps,
        ttt_step_loss_decay=job.model.ttt_step_loss_decay,
        use_off_policy_tokens=job.training.teacher_forcing,
    )


def test_a_job_setting_is_described_once():
    """A trainer field a job sets from one of its settings names that setting (`metadata["job"]`)
    and says no more than its flag: the job field's docstring (the flag's --help) is its one
    description, which `TrainerConfig.field_doc` gives; the trainer's own fields keep theirs."""
    from speculators_vllm016.train.jobs.job_config import all_fields
    from speculators_vllm016.utils.field_docs import field_docs

    flags = {f"{section}.{spec.name}": (spec.flag, spec.doc) for section, spec in all_fields()}
    own = field_docs(TrainerConfig)
    mirrored = [item for item in dataclasses.fields(TrainerConfig) if "job" in item.metadata]
    assert len(mirrored) == 18
    for item in mirrored:
        flag, doc = flags[item.metadata["job"]]
        # The flag, at most with a note of what the trainer does with it; no second description.
        assert own[item.name] == f"`{flag}`." or own[item.name].startswith(f"`{flag}` ("), item.name
        assert TrainerConfig.field_doc(item.name) == doc
    for item in dataclasses.fields(TrainerConfig):
        if "job" not in item.metadata:
            assert TrainerConfig.field_doc(item.name) == own[item.name] != "", item.name
