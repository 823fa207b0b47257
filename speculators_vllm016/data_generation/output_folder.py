"""A datagen output folder and the protocol every writer of one follows.

    <folder>/data_{idx}.pt ...            sample files (`sample_io`), whole or absent
    <folder>/.locks/shard-I-of-N.lock      held by the one process writing shard I
    <folder>/.tmp/<writer>/                that process's temporary files (`sample_io.WriterSlot`)
    <folder>/.datagen_state.json           the run identity: a resume must be the same run (`resume`)
    <folder>/manifest/shard-I-of-N.jsonl   one line per whole file (`manifest`)
    <folder>/token_freq/shard-I-of-N.pth   token counts of shard I's samples (`token_counts`)
    <folder>/data_config.json              how the samples were made (`config_generator`)

`speculators datagen` writes its `--output-dir` through `DatagenFolder`, and so does online
training for its `--cache-dir` (one shard of one): the cache is an ordinary datagen folder. Error
messages name the folder by the flag that gave it (`flag`), so each command speaks its own flags.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.data_generation.config_generator import (
    CONFIG_FILE,
    DataGenerationConfig,
)
from speculators_vllm016.data_generation.manifest import ManifestWriter, manifest_path
from speculators_vllm016.data_generation.resume import (
    RunIdentity,
    Signature,
    check_identity,
    record_identity,
    refuse_other_tensors,
    sample_signature,
)
from speculators_vllm016.data_generation.resume import (
    refuse_unrecorded as _refuse_unrecorded,
)
from speculators_vllm016.data_generation.sample_io import (
    WriterSlot,
    remove_partial_files,
)
from speculators_vllm016.data_generation.token_counts import (
    save_token_counts,
    shard_token_freq_path,
)
from speculators_vllm016.utils.atomic_files import atomic_write_json
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.file_lock import try_lock_file

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.options import DatagenOptions

__all__ = ["LOCK_DIR", "DatagenFolder", "FolderInUse", "ShardLock", "data_config_of"]

logger = logging.getLogger(__name__)

LOCK_DIR = ".locks"


class FolderInUse(InvalidInputError):
    """Another process holds the lock of this shard of the folder."""


class ShardLock:
    """Held for a whole run: a second process on the same shard of one folder is refused."""

    def __init__(
        self, output_dir: Path, shard_index: int, num_shards: int, flag: str = "--output-dir"
    ) -> None:
        folder = Path(output_dir) / LOCK_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"shard-{shard_index}-of-{num_shards}.lock"
        self.output_dir = Path(output_dir)
        self.shard_index, self.num_shards, self.flag = shard_index, num_shards, flag
        self._fd: int | None = None

    def __enter__(self) -> ShardLock:
        self._fd = try_lock_file(self.path)
        if self._fd is None:
            sharded = self.num_shards > 1
            which = f" for shard {self.shard_index} of {self.num_shards}" if sharded else ""
            other = "--shard-index" if sharded else self.flag
            raise FolderInUse(
                f"another process is using {self.flag} {self.output_dir}{which}; wait for it to "
                f"finish, or give this run another {other}"
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DatagenFolder:
    """One shard's hold on a datagen folder: its lock, writer slot, manifest and records.

    Set-up goes step by step (`prepare`, `lock`, `open_slot`, ...) so a caller can say which step
    failed in its own words; `close()` gives back whatever was taken, in reverse, and is safe to
    call at any point. `flag` is the command-line flag that named the folder (`--output-dir`,
    `--cache-dir`); `adopt_flag` the flag that accepts unrecorded files, None where there is none.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        fsync: bool = False,
        flag: str = "--output-dir",
        adopt_flag: str | None = "--adopt-existing",
    ) -> None:
        self.path = Path(path)
        self.shard_index, self.num_shards = shard_index, num_shards
        self.fsync = fsync
        self.flag, self.adopt_flag = flag, adopt_flag
        self.slot: WriterSlot | None = None
        self.manifest: ManifestWriter | None = None
        self._lock: ShardLock | None = None

    # -- set-up ----------------------------------------------------------------------------------
    def prepare(self) -> bool:
        """Create the folder (refusing a file or an unwritable place); True if created here."""
        path, flag = self.path, self.flag
        if path.exists() and not path.is_dir():
            raise InvalidInputError(f"{flag} {path} is a file; name a folder")
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InvalidInputError(
                f"cannot create {flag} {path} ({error.strerror}); choose a writable place"
            ) from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise InvalidInputError(f"{flag} {path} is not writable; choose a writable place")
        return created

    def lock(self) -> None:
        """Take this shard's lock (`FolderInUse` when another process holds it)."""
        lock = ShardLock(self.path, self.shard_index, self.num_shards, self.flag)
        lock.__enter__()
        self._lock = lock

    def open_slot(self) -> WriterSlot:
        """This process's folder for temporary files; partial files of dead writers are removed."""
        self.slot = WriterSlot(self.path)
        removed = remove_partial_files(self.path)
        if removed:
            logger.info(
                "removed %d partial files left by an interrupted run in %s", removed, self.path
            )
        return self.slot

    def open_manifest(self) -> ManifestWriter:
        self.manifest = ManifestWriter(
            manifest_path(self.path, self.shard_index, self.num_shards), fsync=self.fsync
        )
        return self.manifest

    def close(self) -> None:
        """Close the manifest, remove the writer slot and release the lock (what was taken)."""
        manifest, self.manifest = self.manifest, None
        slot, self.slot = self.slot, None
        lock, self._lock = self._lock, None
        try:
            if manifest is not None:
                manifest.close()
        finally:
            try:
                if slot is not None:
                    slot.close()
            finally:
                if lock is not None:
                    lock.__exit__(None, None, None)

    def __enter__(self) -> DatagenFolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the run's records -----------------------------------------------------------------------
    def refuse_unrecorded(self, adopt_existing: bool) -> None:
        """Sample files without a record of their run are refused unless adopted."""
        _refuse_unrecorded(self.path, adopt_existing, flag=self.flag, adopt_flag=self.adopt_flag)

    def check_identity(self, identity: RunIdentity, adopt_existing: bool = False) -> bool:
        """Refuse a folder of another run; returns whether `identity` must still be recorded."""
        return check_identity(
            self.path, identity, adopt_existing, flag=self.flag, adopt_flag=self.adopt_flag
        )

    def record_identity(self, identity: RunIdentity) -> None:
        """Record the run unless another process recorded one meanwhile, which must be the
        same run (shards started together); a different one is refused."""
        record_identity(
            self.path, identity, exclusive=True, flag=self.flag, adopt_flag=self.adopt_flag
        )

    def listed_signatures(self) -> dict[Signature, str]:
        """What the first whole file the manifests list holds (`resume.Signature`); {} if none."""
        from speculators_vllm016.data_generation.manifest import read_manifest

        for name, record in sorted(read_manifest(self.path).items(), key=lambda kv: kv[1].index):
            path = self.path / name
            if path.is_file() and path.stat().st_size == record.bytes:
                found = sample_signature(path)
                if found is not None:
                    return {found: name}
        return {}

    def refuse_other_tensors(
        self, signatures: dict[Signature, str], dtype: Any, hidden_size: int
    ) -> None:
        """Refuse an engine whose hidden states (dtype, width) differ from the kept files'."""
        refuse_other_tensors(self.path, signatures, dtype, hidden_size, flag=self.flag)

    def write_token_counts(self, counts: dict[int, int], also_to: str | None = None) -> None:
        """This shard's counts beside the data, and at `also_to` (0.3.0's `--token-freq-path`;
        `.shard-I-of-N` is added to its name when the job is sharded)."""
        own = save_token_counts(
            counts, shard_token_freq_path(self.path, self.shard_index, self.num_shards)
        )
        logger.info("token counts of this shard: %s", own)
        if also_to:
            path = Path(also_to)
            if self.num_shards > 1:
                path = path.with_name(
                    f"{path.stem}.shard-{self.shard_index}-of-{self.num_shards}{path.suffix}"
                )
            save_token_counts(counts, path)
            logger.info("token counts also in %s", path)

    def write_data_config(
        self,
        generator: Any,
        options: DatagenOptions,
        num_samples: int,
        target_config: dict | None = None,
    ) -> None:
        """Write `data_config.json` of a run whose engine is `generator`; when no engine ran
        (every file was already there) the one written by the run that made them stands.
        `target_config`: the target's config.json as the run read it (not read again)."""
        config = data_config_of(generator, options, num_samples, target_config)
        if config is not None:
            atomic_write_json(self.path / CONFIG_FILE, config.to_dict())


def data_config_of(
    generator: Any, options: DatagenOptions, num_samples: int, target_config: dict | None = None
) -> DataGenerationConfig | None:
    """`data_config.json` of a run whose engine is `generator`; None when no engine ran."""
    from datasets import config as datasets_config

    from speculators_vllm016.data_generation.sample_io import SAMPLE_PATTERNS

    if generator is None:
        return None  # nothing ran: the config written by the run that made the files stands
    data = options.preprocessing
    return DataGenerationConfig.from_generator(
        generator=generator,
        train_data_path=data.train_data_path,
        seq_length=data.seq_length,
        cache_dir=str(data.hf_cache_dir or datasets_config.HF_DATASETS_CACHE),
        num_samples=num_samples,
        max_samples=data.max_samples,
        seed=data.seed,
        file_pattern=SAMPLE_PATTERNS[options.output.output_format],
        storage_dtype=options.output.storage_dtype,
        chat_template_kwargs=data.template_kwargs(),
        session_tokens=data.session_tokens,
        sessions_only=data.sessions_only,
        target_config=target_config,
    )
