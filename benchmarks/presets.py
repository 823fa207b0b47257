"""Named benchmark configurations and the settings one run resolves from them.

A preset fixes everything that decides the figures (model, parallelism, engine limits, token
batches) so that numbers from different machines or commits compare like with like. Command-line
flags may override a few knobs; the result is a `BenchSettings`, recorded whole in the JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "PRESETS",
    "BenchSettings",
    "HardwareError",
    "Preset",
    "TinyModelSpec",
    "Workload",
    "build_settings",
    "check_hardware",
    "get_preset",
]

SCHEDULES = ("interleaved", "grouped")


class HardwareError(RuntimeError):
    """The machine lacks what the preset needs (raised before any engine starts)."""


@dataclass(frozen=True)
class Workload:
    """Random token ids of mixed lengths, fixed by the seed: the same batches for every path."""

    num_sequences: int
    min_length: int
    max_length: int
    seed: int = 0

    @property
    def mean_tokens(self) -> int:
        return self.num_sequences * (self.min_length + self.max_length) // 2


@dataclass(frozen=True)
class TinyModelSpec:
    """A Llama the suite builds locally (speculators_vllm016.tiny_models.build_tiny_llama)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048

    @property
    def num_parameters(self) -> int:
        head_dim = self.hidden_size // self.num_attention_heads
        attention = (
            self.hidden_size
            * head_dim
            * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        )
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = 2 * self.vocab_size * self.hidden_size
        return self.num_hidden_layers * (attention + mlp + 2 * self.hidden_size) + embeddings


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    workload: Workload
    # Model: a tiny local build, a default hub id / path, or neither (the user must pass --model).
    tiny_model: TinyModelSpec | None = None
    model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.85
    # Sequences per VllmHiddenStatesGenerator.generate() call in (a), as datagen's --batch-size.
    batch_size: int = 32
    layer_ids: tuple[int, ...] | None = None  # None: the generator's default (EAGLE-3's four)
    num_writer_threads: int = 4  # datagen's default
    output_format: str = "pt"
    repeats: int = 5
    skip_hf: bool = False
    # "interleaved": all paths loaded at once, their runs alternate a b c, b a c, ... so drift
    # (other jobs on the machine) hits them alike. "grouped": one engine at a time, all its repeats
    # in a row (two copies of a large model do not fit, and its start-up takes minutes).
    schedule: str = "interleaved"
    requires_gpu: bool = False
    hardware: str = "any machine vLLM 0.16 runs on (the CPU build included)"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


_GPU_WORKLOAD = Workload(num_sequences=512, min_length=256, max_length=4000, seed=0)

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="smoke",
            description="CI: a tiny Llama, a few hundred tokens, seconds (throughputs mean little)",
            workload=Workload(num_sequences=8, min_length=16, max_length=64, seed=0),
            tiny_model=TinyModelSpec(
                hidden_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=512,
                vocab_size=512,
                max_position_embeddings=256,
            ),
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=128,
            batch_size=8,
            repeats=1,
            schedule="grouped",  # one engine at a time: no settling pauses, fastest for CI
        ),
        Preset(
            name="cpu-small",
            description=(
                "vLLM's CPU build: a 56M-parameter Llama (hidden 768, 8 layers) built locally, "
                "about 6k tokens of mixed lengths"
            ),
            workload=Workload(num_sequences=48, min_length=32, max_length=224, seed=0),
            tiny_model=TinyModelSpec(
                hidden_size=768,
                num_hidden_layers=8,
                num_attention_heads=12,
                num_key_value_heads=4,
                intermediate_size=2048,
                vocab_size=4096,
                max_position_embeddings=1024,
            ),
            dtype="bfloat16",
            max_num_seqs=32,
            max_num_batched_tokens=2048,
            max_model_len=512,
            batch_size=128,  # datagen's default: the whole workload in one streamed call
            repeats=5,
        ),
        Preset(
            name="llama-3.1-8b-tp1",
            description="Llama-3.1-8B-Instruct on one GPU",
            workload=_GPU_WORKLOAD,
            model="meta-llama/Llama-3.1-8B-Instruct",
            batch_size=64,
            schedule="grouped",
            requires_gpu=True,
            hardware="1 NVIDIA GPU with at least 40 GB (A100/H100/L40S/RTX PRO 6000)",
        ),
        Preset(
            name="llama-3.3-70b-tp4",
            description="Llama-3.3-70B-Instruct at tensor parallel 4",
            workload=_GPU_WORKLOAD,
            model="meta-llama/Llama-3.3-70B-Instruct",
            tensor_parallel_size=4,
            batch_size=64,
            schedule="grouped",
            requires_gpu=True,
            hardware="4 NVIDIA GPUs with at least 80 GB each (A100-80G/H100/RTX PRO 6000)",
        ),
        Preset(
            name="qwen3-30b-a3b-tp2",
            description="Qwen3-30B-A3B (MoE, 128 experts, 8 active) at tensor parallel 2",
            workload=_GPU_WORKLOAD,
            model="Qwen/Qwen3-30B-A3B",
            tensor_parallel_size=2,
            batch_size=64,
            schedule="grouped",
            requires_gpu=True,
            hardware="2 NVIDIA GPUs with at least 48 GB each (A100/H100/L40S/RTX PRO 6000)",
        ),
        Preset(
            name="kimi-k2.5-8xrtxpro6000",
            description=(
                "the headline: Kimi-K2.5 (1T-parameter MoE, MLA) at tensor parallel 8 on "
                "8x RTX PRO 6000; model path from --model"
            ),
            workload=Workload(num_sequences=256, min_length=256, max_length=4000, seed=0),
            model=None,
            dtype="auto",
            tensor_parallel_size=8,
            gpu_memory_utilization=0.9,
            batch_size=64,
            repeats=3,
            skip_hf=True,  # transformers cannot hold a 1T-parameter model on these GPUs
            schedule="grouped",
            requires_gpu=True,
            hardware="8x NVIDIA RTX PRO 6000 Blackwell (96 GB each), one host",
        ),
    )
}


@dataclass(frozen=True)
class BenchSettings:
    """Everything one benchmark run uses: the preset with the command line's overrides."""

    preset: Preset
    model: str | None  # None: the preset's tiny model, built at run time
    repeats: int
    skip_hf: bool
    schedule: str
    output_dir: str
    plot: bool = False
    samples_dir: str | None = None  # where (a) writes its sample files; default under output_dir
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.preset.world_size

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["preset"] = asdict(self.preset)
        return payload


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


# Preset fields a command-line flag may change (flag name = field name with dashes).
OVERRIDABLE = (
    "dtype",
    "batch_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "num_writer_threads",
    "output_format",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)


def build_settings(
    preset_name: str,
    *,
    model: str | None = None,
    repeats: int | None = None,
    skip_hf: bool = False,
    schedule: str | None = None,
    output_dir: str = "benchmarks/results",
    plot: bool = False,
    samples_dir: str | None = None,
    **overrides: Any,
) -> BenchSettings:
    """Resolve a preset and the command line into settings; refuse inconsistent ones."""
    preset = get_preset(preset_name)
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"cannot override {unknown}; overridable: {list(OVERRIDABLE)}")
    applied = {key: value for key, value in overrides.items() if value is not None}
    preset = replace(preset, **applied)
    if model is None and preset.tiny_model is None:
        if preset.model is None:
            raise ValueError(
                f"preset {preset.name!r} needs --model: the path (or hub id) of the "
                f"checkpoint to benchmark ({preset.description})"
            )
        model = preset.model
    repeats = preset.repeats if repeats is None else repeats
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    schedule = preset.schedule if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {SCHEDULES}, got {schedule!r}")
    workload = preset.workload
    if workload.max_length > preset.max_model_len - 1:
        raise ValueError(
            f"preset {preset.name!r}: sequences of up to {workload.max_length} tokens need "
            f"max_model_len > {workload.max_length}, got {preset.max_model_len}"
        )
    for name in ("batch_size", "max_num_seqs", "max_num_batched_tokens", "num_writer_threads"):
        if getattr(preset, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(preset, name)}")
    if preset.output_format not in ("pt", "safetensors"):
        raise ValueError(
            f"output_format must be 'pt' or 'safetensors', got {preset.output_format!r}"
        )
    return BenchSettings(
        preset=preset,
        model=model,
        repeats=repeats,
        skip_hf=skip_hf or preset.skip_hf,
        schedule=schedule,
        output_dir=output_dir,
        plot=plot,
        samples_dir=samples_dir,
        overrides=applied,
    )


def check_hardware(settings: BenchSettings, device_count: int | None = None) -> None:
    """Refuse a GPU preset on a machine with too few CUDA GPUs, before anything starts."""
    preset = settings.preset
    if not preset.requires_gpu:
        return
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = preset.world_size
    if device_count >= needed:
        return
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    found = f"found {device_count} CUDA GPU{'s' if device_count != 1 else ''}"
    if visible is not None:
        found += f" (CUDA_VISIBLE_DEVICES={visible!r})"
    raise HardwareError(
        f"preset {preset.name!r} needs {needed} CUDA GPU{'s' if needed != 1 else ''} "
        f"(tensor_parallel_size={preset.tensor_parallel_size} x "
        f"pipeline_parallel_size={preset.pipeline_parallel_size}; intended hardware: "
        f"{preset.hardware}) but torch.cuda.device_count() {found}. Run it on such a machine "
        "with the official vllm==0.16 build, or use --preset cpu-small / smoke here."
    )
