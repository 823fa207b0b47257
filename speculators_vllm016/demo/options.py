"""What a demo run is asked to do: the flags of `speculators demo --help` without the dashes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoOptions"]


@dataclass
class DemoOptions:
    output_dir: str = "output/demo"
    max_samples: int | None = 160
    seq_length: int = 1024
    batch_size: int = 128
    output_format: str = "pt"
    target_steps: int = 50
    target_row_tokens: int = 128
    target_rows_per_step: int = 8
    target_long_row_tokens: int = 2048
    """The target's long rows: sessions of chained turns of about this many tokens, so it answers
    at the long prompts as at short ones (`demo.target`); 0: short rows only."""
    target_long_every: int = 5
    """Every N-th target step trains on one long row instead of the short rows."""
    draft_vocab_size: int = 512
    epochs: int = 3
    lr: float = 1e-3
    total_seq_len: int = 2048
    eval_prompts: int = 24
    max_new_tokens: int = 32
    seed: int = 0
    dtype: str = "auto"
    """The extraction engine's dtype; "auto" is resolved by `demo.engine_dtype` when the run starts."""
    held_out_every: int = 6
    """Every N-th distinct opening question is held out for the evaluation (`demo.held_out`)."""
    regenerate: bool = True
    """Also train a draft on the drafts' conversations answered by the target itself."""
    regenerate_max_tokens: int = 64
    serve: bool = True
    """Last, serve the held-out prompts with vLLM and each trained draft (`demo.serving`)."""
    long_context: int = 1750
    """The serve stage also serves the held-out questions after earlier turns of other held-out
    conversations, prompts of about this many tokens (0: short prompts only), and reports each
    draft's tau there beside the short prompts' (`demo.serving`)."""
    sliding_window: int | None = None
    """Both drafts' attention window in training and serving (`train --sliding-window`); None:
    full attention."""
    show_progress: bool = True
