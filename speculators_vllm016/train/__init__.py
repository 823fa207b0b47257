"""Draft training: sample files -> packed rows -> trainer -> checkpoints vLLM serves.

Modules (0.3.0's paths): `data` (sample files, packing contract), `distributed_batch_sampler`,
`noise_transforms`, `checkpointer`, `trainer`, `logger`, `utils`, `vocab_mapping`. None of them
imports vLLM: training runs where vLLM is not installed.
"""
