"""The sections of `speculators train`'s job config: every setting, typed, with its meaning.

Each section is a dataclass (a top-level key of a YAML job file) and the docstring under each
field says what the setting does, its unit and why its default: `speculators train --help` shows
those very words (`job_config.config_fields` reads them). The online section nests datagen's own
option parts (`DatagenPart` says which fields it shows, renamed how, with what note).

How the sections are read from a command line or a YAML file, and written back, is
`job_config`'s; which settings are wrong together is `setup`'s.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from speculators_vllm016.data_generation.options import (
    DatagenOptions,
    EngineOptions,
    OutputOptions,
    PreprocessingOptions,
)

__all__ = [
    "CHECKPOINT_DTYPES",
    "CheckpointConfig",
    "DataConfig",
    "DatagenPart",
    "LegacyConfig",
    "LoggingConfig",
    "ModelConfig",
    "OnlineConfig",
    "RuntimeConfig",
    "TrainingConfig",
    "VocabConfig",
    "datagen_part",
]

CHECKPOINT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ModelConfig:
    """the verifier and the draft's shape (0.3.0)"""

    verifier_name_or_path: str = field(default="", metadata={"required": True})
    """The target model that generated the data (local folder or hub id). The draft copies its
    layer shape and vocabulary; required."""
    draft_arch: str = field(default="llama", metadata={"choices": ["llama", "mla"]})
    """The draft's decoder layer. "llama": a Llama layer the target's width (0.3.0's, what vLLM
    0.16 serves natively). "mla": one DeepSeek-V3 layer with multi-head latent attention shaped
    from a DeepSeek-V2/V3 or Kimi-K2/K2.5 target (576 KV-cache values per token at Kimi-K2.5
    shape instead of a Llama layer's 16,384), saved as vLLM >= 0.18 and TorchSpec's
    `Eagle3DeepseekV2ForCausalLM` and served on vLLM 0.16 through this package's plugin."""
    num_layers: int = 1
    """Decoder layers of the draft. 1, as 0.3.0 and the EAGLE-3 paper: a deeper draft is slower
    to run than it gains in acceptance."""
    ttt_steps: int = 3
    """Test-time-training steps: tokens the draft proposes in a row during training (0.3.0's
    default), also written as the served number of speculative tokens."""
    ttt_step_loss_decay: float = 1.0
    """The loss of TTT step k is weighted decay**k; 1.0 (0.3.0) weighs every step alike."""
    norm_before_residual: bool = field(default=True, metadata={"negatable": True})
    """Normalize the fused hidden state before the residual add (0.3.0's hard-coded choice)."""
    sliding_window: int | None = None
    """Sliding-window draft attention: each position attends to the keys fewer than this many
    positions back, in training and as vLLM 0.16 serves it (`layer_types: sliding_attention`);
    meant to keep acceptance at prompts longer than the rows trained on (measure it: `eval
    --context-lengths`). At least --ttt-steps. None: full attention. With --from-pretrained it
    replaces the draft's window (a window changes no weight; the saved config has the new one);
    left out, the draft keeps its own attention, windowed or not."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm per auxiliary target state before they are fused (config key and
    weights as upstream speculators 0.7 and vLLM >= 0.22 read them; served on 0.16 by this
    package's vLLM plugin). Excludes --norm-before-fc."""
    norm_output: bool = False
    """EAGLE-3.1: each TTT step feeds the next its hidden state after the final norm."""
    norm_before_fc: bool = False
    """One RMSNorm over all auxiliary target states together before they are fused."""
    from_pretrained: str | None = None
    """Fine-tune an existing EAGLE-3 draft (a folder or hub id): this package's, speculators
    0.3.0's, upstream 0.7's, or a research/SpecForge, TorchSpec or Model Optimizer checkpoint
    (converted as `speculators convert` does, fused layers mapped into vLLM's numbering; a
    research/SpecForge one does not record --norm-before-residual, so give its value). It seeds a fresh
    run only: its served weights (model.safetensors) bit for bit, a fresh optimizer and schedule;
    a --save-path that already has checkpoints resumes them instead and does not read it. Its verifier, hidden size,
    vocabularies, fused layers, layer count and norms must match this run (each mismatch is
    named, and nothing is written); --sliding-window applies to it; without --d2t-path/--draft-vocab-size it trains with the draft's own
    maps. None: a new draft."""
    allow_other_verifier: bool = False
    """Train against a verifier whose final norm and LM head differ from those of the model the
    data was extracted from (data_config.json records them; --target-model-path with --online):
    refused without this flag, as it is usually a wrong path."""


@dataclass
class DataConfig:
    """where the hidden states are and how they are split (0.3.0)"""

    data_path: str = "./data"
    """Datagen's output folder (its --output-dir), read unless --online."""
    data_format_version: int = field(default=1, metadata={"choices": [0, 1]})
    """1: datagen's files; 0: legacy files with hidden_state/target keys."""
    train_ratio: float = 0.9
    """Share of the sample files used for training, in (0, 1]; the rest validates (0.3.0's
    split). 1 trains on all, with no validation."""
    split_seed: int = 0
    """Seed of the train/validation split, apart from --seed so the split stays put when the
    training seed changes."""
    strict_data: bool = False
    """Stop at the first unreadable or non-finite sample instead of skipping it (skipping keeps a
    long run alive; the skipped samples are counted in the metrics)."""


@dataclass
class VocabConfig:
    """the draft vocabulary maps d2t/t2d, read or built (0.3.0)"""

    d2t_path: str | None = None
    """Draft->target offsets (.npy), as `speculators vocab-mapping` writes them. None: the run's
    own <save-path>/d2t.npy (built there by --draft-vocab-size); without --draft-vocab-size,
    ./d2t.npy (0.3.0's default) when the run has none."""
    t2d_path: str | None = None
    """Target->draft mask (.npy), the pair of --d2t-path (None: beside it, as --d2t-path)."""
    draft_vocab_size: int | None = None
    """Tokens the draft predicts: build d2t/t2d from token counts (saved beside the
    checkpoints) when the .npy files do not exist; maps of another size stop the run. None: the
    files must exist."""
    token_freq_path: str | None = None
    """Token counts for --draft-vocab-size: a token_freq.pt, or a datagen folder (its
    token_freq/ shards, summed) as vocab-mapping takes it. None: datagen's token_freq/ or
    token_freq*.pt in --data-path."""


@dataclass
class CheckpointConfig:
    """where, how often, how many, in which dtype"""

    save_path: str = "./checkpoints"
    """Checkpoints go to <save-path>/<epoch>/ (vLLM serves each); the resolved config to
    <save-path>/train_config.yaml."""
    no_resume_from_checkpoint: bool = False
    """Start from scratch even if --save-path has checkpoints (by default a run resumes from the
    newest one, ending as an uninterrupted run would)."""
    checkpoint_freq: float | None = None
    """Also checkpoint every this fraction of an epoch (0.25: 4 per epoch); None: once an epoch."""
    keep_mid_epoch_checkpoints: int = 1
    """Mid-epoch checkpoints (--checkpoint-freq, SIGTERM, --max-steps) kept after the newest epoch
    checkpoint; the one just written is always kept, so 0 behaves like 1."""
    keep_last: int | None = None
    """Keep only the newest N checkpoints of any kind (epoch or mid-epoch) and the best one by
    validation tau_sim; older ones are deleted once a new one is in place (default: all)."""
    checkpoint_dtype: str = field(default="bf16", metadata={"choices": sorted(CHECKPOINT_DTYPES)})
    """Dtype of the served model.safetensors; bf16 is what vLLM serves a draft in (training keeps
    fp32 masters either way)."""
    background_checkpoints: bool = field(default=True, metadata={"negatable": True})
    """Write checkpoints in a background thread: the step loop waits only for a snapshot of the
    weights and optimizer state (a copy on the GPU where it has room) and trains on while the
    files are written. --no-background-checkpoints writes them in the step loop, copying
    nothing (for a machine short of memory, or to debug a write). Either way a crash leaves the
    previous or the new checkpoint whole."""


@dataclass
class TrainingConfig:
    """the schedule, the optimizer and the input noise"""

    epochs: int = 20
    """Passes over the training files (0.3.0's default). They are numbered from 0, as the
    checkpoint folders <save-path>/<epoch>/ are; a finished run reruns as "already complete":
    raise --epochs to train it further."""
    lr: float = 1e-4
    """Peak learning rate of AdamW (0.3.0's default). A resumed run uses the value given now
    (as every optimizer and --scheduler-* setting), from the resumed step on, with a warning
    naming each change old -> new."""
    total_seq_len: int = 8192
    """Tokens per packed row, the unit of a step on each process (0.3.0's default)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (0.3.0's value)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm (0.3.0's value)."""
    scheduler_type: str = field(
        default="linear", metadata={"choices": ["linear", "cosine", "none"]}
    )
    """Learning-rate schedule after the warm-up: linear or cosine decay to 0, or constant."""
    scheduler_warmup_steps: int | None = None
    """Steps of linear warm-up; None: 1% of the steps trained (epochs x steps per epoch, capped at
    --max-steps)."""
    scheduler_total_steps: int | None = None
    """Steps over which the schedule decays; None: all steps."""
    scheduler_num_cosine_cycles: float = 0.5
    """Cosine cycles over the total steps; 0.5 is one half-wave from the peak to 0."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (a checkpoint is written there); None: all epochs."""
    seed: int = 0
    """Seeds the draft's initial weights, the shuffling and the noise."""
    noise_type: str = field(
        default="uniform", metadata={"choices": ["uniform", "gaussian", "none"]}
    )
    """Noise on the fused input states, as 0.3.0 (uniform) regularizes the draft."""
    noise_std: float = 0.05
    """Noise scale (the half-width for uniform noise, as 0.3.0)."""
    teacher_forcing: bool = field(default=True, metadata={"negatable": True})
    """Later TTT steps read the true next tokens (D7, as upstream later fixed it);
    --no-teacher-forcing feeds the draft's own predictions, as 0.3.0 did."""


@dataclass
class RuntimeConfig:
    """devices, parallelism, loader"""

    precision: str = field(default="auto", metadata={"choices": ["auto", "fp32", "bf16"]})
    """auto: bf16 compute with fp32 master weights on GPU, fp32 on CPU (where bf16 is slow)."""
    parallel: str = field(default="fsdp", metadata={"choices": ["fsdp", "ddp"]})
    """Data parallelism under torchrun; FSDP2 shards the optimizer state, DDP replicates it."""
    fsdp_bf16_params: bool = False
    """--parallel fsdp: gather bf16 copies of the weights, not the fp32 masters (half the traffic:
    for slow links; norms then use bf16 weights, so the numerics differ slightly from one-GPU
    training)."""
    deterministic: bool = False
    """GPU runs reproducible bit for bit, resumed or not: compiled blocks take symbolic shapes
    from the first step and skip autotuning that changes rounding (about 7% slower a step on an
    H200); CPU runs always are."""
    device: str | None = None
    """cpu or cuda; None: the GPU if there is one."""
    compile_cache_dir: str | None = None
    """Keep torch's compile caches (kernels built for the draft's blocks) in this folder, e.g.
    beside --save-path: a resumed run on a fresh machine then starts with its kernels built
    (the first step's compile is most of its time). None: torch's default, /tmp, lost with
    the machine."""
    num_workers: int | None = None
    """Loader processes; None: min(12, CPUs) (0.3.0 used 12)."""
    prefetch_factor: int = 4
    """Packed rows each loader process prepares ahead (0.3.0's value)."""
    row_slots: bool = field(default=True, metadata={"negatable": True})
    """On a GPU the loader processes pack rows into a ring of host buffers pinned once (the rows in
    flight + 2, at most 8 GiB unless 8 rows need more; 4 rows for validation), in shared memory;
    --no-row-slots: a fresh shared-memory row each time, copied again into pinned memory."""


@dataclass
class LoggingConfig:
    """loggers and messages (0.3.0)"""

    logger: str = ""
    """Comma list of tensorboard, wandb, trackio; metrics.jsonl beside the checkpoints is always
    written."""
    log_dir: str = "./logs"
    """Folder of the tensorboard/trackio logs."""
    run_name: str | None = None
    """Run name for the loggers; None: their own default."""
    no_progress: bool = False
    """No progress bars (for logs that are files)."""
    debug: bool = False
    """Show tracebacks on errors instead of one line."""
    verbose: bool = False
    """--online: show vLLM's own start-up lines (by default only its warnings and errors show, as
    in datagen)."""


@dataclass
class LegacyConfig:
    """0.3.0 behaviour (each changes the trained weights)"""

    no_verifier_norm: bool = False
    """Score targets without the verifier's final norm (D1)."""
    noise_on_targets: bool = False
    """Also add noise to the teacher's states (D3)."""
    legacy_loss_mask_shift: bool = False
    """Take the loss mask one token ahead instead of two (D9)."""
    bf16_optimizer_state: bool = False
    """Save the optimizer state in bf16 (D2); half the checkpoint size, a resumed run drifts."""


@dataclass(frozen=True)
class DatagenPart:
    """How the online section shows one of datagen's option parts: its fields become the section's
    own flags and YAML keys, with datagen's names, types, defaults, choices and docstrings."""

    names: tuple[str, ...] | None = None
    """The part's fields shown (None: all); the rest keep datagen's defaults or are set by setup."""
    rename: dict[str, str] = field(default_factory=dict)
    """Datagen's field name -> the key and flag name here, where train's own flag of that name
    means something else (`--seed`)."""
    notes: dict[str, str] = field(default_factory=dict)
    """Field name -> a sentence added to datagen's docstring: what the field also does in train."""


def datagen_part(factory: Callable[[], Any], part: DatagenPart) -> Any:
    """A field of the online section that nests one of datagen's option parts (`factory` makes
    its defaults for training: a required field of datagen's is None here, set by setup)."""
    return field(default_factory=factory, metadata={"datagen_part": part})


@dataclass
class OnlineConfig:
    """hidden states extracted live while training (--online), with datagen's flags (its sample
    files are those of --cache-dir)"""

    enabled: bool = field(default=False, metadata={"flag": "--online"})
    """Extract hidden states with the target model while training, instead of reading
    --data-path; the batches equal offline training's on datagen's files of the same samples.
    Under torchrun, rank 0 runs the engine and sends each rank its samples."""
    cache_dir: str | None = None
    """Hybrid mode: also write every extracted sample here as a datagen folder; later epochs (and
    later runs) read it and start no engine."""
    online_queue_size: int = 4
    """Packed rows extracted ahead of the trainer (bounds memory)."""
    extraction_ranks: int = 0
    """Under torchrun: the first K ranks only extract (each runs one engine replica on its own
    devices: TP x PP GPUs of its node, or the CPU) and send each training rank its samples; the
    other ranks only train, among themselves. For a target that fills its machine: extract on one
    node, train on another. 0: rank 0 both extracts and trains."""
    train_devices: str | None = None
    """Where the draft trains: cuda:N (one per training process, e.g. cuda:6,cuda:7 under
    torchrun --nproc-per-node 2) or cpu; the target model's engine gets every other visible GPU
    (CUDA_VISIBLE_DEVICES). None: both time-share the same devices."""
    engine: EngineOptions = datagen_part(
        lambda: EngineOptions(target_model_path=None),  # type: ignore[arg-type]
        DatagenPart(
            notes={
                "target_model_path": "None: --verifier-name-or-path.",
                "gpu_memory_utilization": "The rest is the trainer's when they time-share.",
                "trust_remote_code": "Also applies to reading --verifier-name-or-path's config, "
                "offline too.",
            }
        ),
    )
    preprocessing: PreprocessingOptions = datagen_part(
        lambda: PreprocessingOptions(train_data_path=None),  # type: ignore[arg-type]
        DatagenPart(
            rename={"seed": "data_seed"}, notes={"train_data_path": "Required with --online."}
        ),
    )
    output: OutputOptions = datagen_part(
        lambda: OutputOptions(output_dir=""),
        DatagenPart(
            names=(
                "output_format",
                "storage_dtype",
                "start_idx",
                "layer_ids",
                "num_writer_threads",
                "fsync",
            ),
            notes={
                "layer_ids": "Offline: the layers --data-path holds, needed only for a folder "
                "without datagen's data_config.json (0.3.0's layout from elsewhere), whose layers "
                "the draft's config must name for vLLM; with data_config.json they must agree."
            },
        ),
    )
    """The sample-file settings of the --cache-dir files (output_dir is set from cache_dir)."""

    def datagen_options(self, verifier: str) -> DatagenOptions:
        """Datagen's options of this online run: the nested parts, copied (the options never
        share a list with the config), with what train decides filled in: the target defaults to
        `verifier`, the output folder is --cache-dir ("" for none), no 0.3.0 token-count file
        and no progress bar of datagen's own."""
        engine, output = copy.deepcopy(self.engine), copy.deepcopy(self.output)
        engine.target_model_path = engine.target_model_path or verifier
        output.output_dir, output.token_freq_path = self.cache_dir or "", None
        output.show_progress = False
        return DatagenOptions(
            engine=engine, preprocessing=copy.deepcopy(self.preprocessing), output=output
        )
