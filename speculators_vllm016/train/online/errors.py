"""What goes wrong in online training: the engine, and the --cache-dir folder."""

from __future__ import annotations

from pathlib import Path

from speculators_vllm016.train.data import DataSourceError, SampleFileError
from speculators_vllm016.utils.errors import InvalidInputError, type_and_first_line

__all__ = ["CacheFolderError", "CacheOfOtherTensors", "CacheWriteFailed", "ExtractionFailed"]


class ExtractionFailed(DataSourceError):
    """The target model's engine failed while producing samples."""


class CacheFolderError(InvalidInputError):
    """The --cache-dir folder cannot be used (another run's, in use, not creatable)."""


class CacheOfOtherTensors(SampleFileError):
    """The --cache-dir folder holds hidden states unlike the started engine's (another dtype)."""


class CacheWriteFailed(DataSourceError):
    """Writing a sample into the --cache-dir folder failed (disk full, unwritable, ...)."""

    @classmethod
    def of(cls, folder: Path, error: BaseException) -> CacheWriteFailed:
        return cls(
            f"writing the --cache-dir folder {folder} failed ({type_and_first_line(error)}); "
            "free space there or give another --cache-dir"
        )
