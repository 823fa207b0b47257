"""What a demo run is asked to do: the flags of `speculators demo --help` without the dashes.

Each field is its flag (`cli.field_flags`, as for the other commands): the name gives the flag,
the type and default the flag's, the docstring under it the help, in this order. A switch that
turns a stage off (`--no-serve`) is the field that is on by default, with the flag's name in its
metadata. Where each option is used: `demo.pipeline.stage_options` (`demo.target`,
`demo.held_out`, `demo.serving`, `demo.engine_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculators_vllm016.demo.engine_dtype import ENGINE_DTYPES

__all__ = ["DemoOptions"]


@dataclass
class DemoOptions:
    output_dir: str = "output/demo"
    """folder for everything the demo writes"""
    max_samples: int | None = 160
    """conversations both drafts train on: the first N of those not held out (the package ships
    320)"""
    seq_length: int = 1024
    """truncate samples to this"""
    batch_size: int = 128
    """sequences per extraction call"""
    output_format: str = field(default="pt", metadata={"choices": ("pt", "safetensors")})
    """sample file format"""
    target_steps: int = 50
    """training steps of the target"""
    target_row_tokens: int = 128
    """tokens per short target training row (cut from the conversations' token stream)"""
    target_rows_per_step: int = 8
    """rows per target step"""
    target_long_row_tokens: int = 2048
    """tokens per long target row (turns of the conversations chained into one chat, the long
    prompts' shape), so the target answers at long prompts as at short ones; 0:
    short rows only"""
    target_long_every: int = 5
    """every N-th target step trains on one long row instead of the short rows"""
    draft_vocab_size: int = 512
    """tokens the draft predicts"""
    epochs: int = 3
    """draft training epochs"""
    lr: float = 1e-3
    """draft learning rate"""
    total_seq_len: int = 2048
    """tokens per packed draft row"""
    sliding_window: int | None = None
    """both drafts attend to the last W positions only, in training and as vLLM serves them
    (train --sliding-window); 0: full attention"""
    long_context: int = 1750
    """the serve stage also asks the held-out questions after earlier turns of other
    conversations, prompts of about this many tokens, and prints each draft's tau there and
    long/short; 0: short prompts only"""
    held_out_every: int = 6
    """hold out every N-th distinct opening question of the shipped conversations for the
    evaluation: no row asking it trains the target or a draft"""
    eval_prompts: int = 24
    """held-out prompts for the evaluation"""
    max_new_tokens: int = 32
    """tokens generated per prompt"""
    regenerate_max_tokens: int = 64
    """the regenerated draft's data: at most this many tokens per regenerated answer"""
    regenerate: bool = field(default=True, metadata={"flag": "--no-regenerate"})
    """skip the draft trained on regenerated conversations (saves its regeneration,
    extraction and training)"""
    serve: bool = field(default=True, metadata={"flag": "--no-serve"})
    """skip the last stage, vLLM serving the held-out prompts with each trained draft"""
    seed: int = 0
    """seeds every stage"""
    dtype: str = field(default="auto", metadata={"choices": ENGINE_DTYPES})
    """the extraction engine's dtype; auto: vLLM's choice (bfloat16 for this model) where the CPU
    computes bfloat16 natively, float32 where it would be emulated (about 5x slower)"""
    show_progress: bool = field(default=True, metadata={"flag": "--no-progress"})
    """hide the progress bars"""
