"""Draft training: sample files -> packed rows -> trainer -> checkpoints vLLM serves.

At the top: the trainer (`trainer`, `train_step`, `trainer_config`, `optimizer_step`,
`lr_schedule`, `metrics_log`, `draft_contract`, `graceful_shutdown`, `errors`) and 0.3.0's module
paths (`data`, `distributed_batch_sampler`, `noise_transforms`, `checkpointer`, `logger`, `utils`,
`vocab_mapping`, with `vocab_maps`). The wings:

- `jobs/`: one training job from its config (`job_config`, `setup`, `draft_build`, `rank_plan`,
  `loaders`, `job`, `devices`, `resume`, `pretrained_draft`, `draft_match`, `verifier_identity`,
  `vocab_size_rule`);
- `loading/`: sample files to device rows (`loader_contract`, `sample_loader`, `row_slots`,
  `device_rows`);
- `online/`: hidden states extracted while training (`loader`; for `--extraction-ranks`:
  `split`, `rank_layout`, `split_groups`, `sample_transport`, `extraction_rank`, `remote_loader`);
- `checkpointing/`: the files of a checkpoint (`checkpoint_files`, `rng_state`,
  `named_optimizer_state`, `save_lock`).

None of them imports vLLM at import time: training runs where vLLM is not installed.
"""
