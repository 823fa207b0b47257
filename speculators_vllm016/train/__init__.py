"""Draft training: sample files -> packed rows -> trainer -> checkpoints vLLM serves.

Modules (0.3.0's paths): `data` (sample files, packing contract), `distributed_batch_sampler`,
`noise_transforms`, `checkpointer`, `trainer`, `logger`, `utils`, `vocab_mapping`. The job and
its parts: `job_config`, `setup`, `job`, `online` and, for `--extraction-ranks`, `rank_layout`,
`split_groups`, `sample_transport`, `extraction_rank`, `remote_loader`, `split_online` (README,
"Package layout", lists every module). None of them imports vLLM at import time: training runs
where vLLM is not installed.
"""
