"""The offline data folder (`--data-path`) as a training job reads it: once, at its start.

Its sample files are listed, its `data_config.json` (datagen's record: the captured layers, the
model the data comes from and its fingerprint, the storage dtype) and its first sample are read
once into a `DataFolder`; `setup.prepare`'s checks of the data (layer ids, widths, the verifier
it comes from) are functions of it and open no file of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.job_config import TrainSetupError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.config_generator import DataGenerationConfig

__all__ = ["DataFolder", "read_data_folder"]


@dataclass
class DataFolder:
    """One datagen output folder: what training checks before it reads a batch."""

    path: Path
    files: list[Path]
    """Its complete sample files (data_<i>.pt / data_<i>.safetensors), at least one."""
    record: DataGenerationConfig | None
    """Its `data_config.json`; None when it has none (0.3.0's layout from elsewhere)."""
    _first_sample: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def sample_count(self) -> int:
        return len(self.files)

    @property
    def layer_ids(self) -> list[int] | None:
        """The captured layers datagen recorded (its numbering); None when it does not say."""
        record = self.record
        if record is None or record.hidden_states is None or record.hidden_states.layer_ids is None:
            return None
        return list(record.hidden_states.layer_ids)

    @property
    def model(self) -> Any:
        """The record's `model` section (the target the data comes from), or None."""
        return None if self.record is None else self.record.model

    @property
    def storage_dtype(self) -> str | None:
        """The dtype its hidden states are stored in, as recorded (None: not recorded)."""
        fmt = None if self.record is None else self.record.format
        return getattr(fmt, "storage_dtype", None)

    def first_sample(self) -> dict[str, Any]:
        """Its first sample file's dict, read the first time it is asked for (one line if not)."""
        if self._first_sample is None:
            from speculators_vllm016.data_generation.sample_io import load_sample

            path = self.files[0]
            try:
                self._first_sample = load_sample(path)
            except Exception as error:  # noqa: BLE001
                raise TrainSetupError(
                    f"cannot read sample {path} ({error}); regenerate the data"
                ) from None
        return self._first_sample


def read_data_folder(data_path: Path) -> DataFolder:
    """List --data-path's sample files (at least one) and read its `data_config.json`."""
    from speculators_vllm016.data_generation.config_generator import read_data_config
    from speculators_vllm016.train.data import list_files

    if not data_path.is_dir():
        raise TrainSetupError(
            f"--data-path {data_path} is not a folder; run `speculators datagen` first"
        )
    files = list_files(data_path)
    if not files:
        raise TrainSetupError(
            f"no sample files (data_<i>.pt / data_<i>.safetensors) under {data_path}; "
            "point --data-path at datagen's --output-dir"
        )
    return DataFolder(path=data_path, files=files, record=read_data_config(data_path))
