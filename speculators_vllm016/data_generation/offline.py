"""The offline data-generation pipeline: chat data -> hidden-state sample files.

dataset -> preprocessing -> this shard's samples -> generator (vLLM) -> writer threads -> files.
Extraction of batch k+1 overlaps the writing of batch k. A run resumes where a crash left it:
batches whose files all exist are skipped; a batch missing any file is recomputed whole (so every
file is bit-identical to an uninterrupted run's) and only the missing files are written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from speculators_vllm016.data_generation.manifest import (
    ManifestWriter,
    SampleRecord,
    manifest_path,
    read_manifest,
)
from speculators_vllm016.data_generation.preflight import ModelFacts, inspect_model, remote_code_hint
from speculators_vllm016.data_generation.resume import (
    STATE_FILE,
    RunIdentity,
    check_identity,
    has_sample_files,
    record_identity,
    refuse_unrecorded,
    samples_digest,
    verify_present,
)
from speculators_vllm016.data_generation.token_counts import (
    save_token_counts,
    shard_token_freq_path,
)
from speculators_vllm016.data_generation.transfer import check_transfer_space
from speculators_vllm016.data_generation.sample_io import (
    SAMPLE_PATTERNS,
    WriterSlot,
    WrittenFile,
    _try_lock,
    existing_sample_indices,
    remove_partial_files,
    sample_path,
    write_sample_file,
)

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.preprocessing import PreprocessResult

__all__ = [
    "DatagenOptions",
    "DatagenSummary",
    "SampleRequest",
    "SampleWriterPool",
    "StreamTotals",
    "extract_and_write",
    "preprocess_samples",
    "run_datagen",
    "shard_positions",
    "start_generator",
]

logger = logging.getLogger(__name__)

LOCK_DIR = ".locks"
CONFIG_FILE = "data_config.json"
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass
class DatagenOptions:
    """Every setting of a datagen run; names follow 0.3.0's command-line flags."""

    target_model_path: str
    train_data_path: str
    output_dir: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None  # default: seq_length + 1
    gpu_memory_utilization: float = 0.8
    seq_length: int = 2048
    max_samples: int | None = None
    token_freq_path: str | None = None  # 0.3.0: "./token_freq.pt"; now beside the data
    hf_cache_dir: str | None = None
    assistant_pattern: str | None = None
    turn_dropout: bool = False
    layer_ids: list[int] | None = None
    batch_size: int = 128
    seed: int = 0
    start_idx: int = 0
    num_preprocessing_workers: int = 8
    num_shards: int = 1
    shard_index: int = 0
    output_format: str = "pt"
    dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_writer_threads: int = 4
    fsync: bool = False
    show_progress: bool = True
    adopt_existing: bool = False
    trust_remote_code: bool = False
    transfer_root: str | None = None

    def validate(self) -> None:
        """Every check the flags alone allow; a ValueError names the flag and what it needs."""
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--num-writer-threads", self.num_writer_threads),
            ("--num-preprocessing-workers", self.num_preprocessing_workers),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-samples", self.max_samples),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.assistant_pattern is not None:
            import re

            try:
                re.compile(self.assistant_pattern)
            except re.error as error:
                raise ValueError(
                    f"--assistant-pattern is not a valid regular expression ({error})"
                ) from None
        if self.num_shards < 1:
            raise ValueError(f"--num-shards must be at least 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"--shard-index must be in [0, {self.num_shards}), got {self.shard_index}"
            )
        if self.output_format not in SAMPLE_PATTERNS:
            raise ValueError(f"--output-format must be one of {sorted(SAMPLE_PATTERNS)}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.seq_length < 1:
            raise ValueError(f"--seq-length must be at least 1, got {self.seq_length}")
        if self.start_idx < 0:
            raise ValueError(f"--start-idx must be non-negative, got {self.start_idx}")
        if self.max_model_len is not None and self.max_model_len <= self.seq_length:
            raise ValueError(
                f"--max-model-len {self.max_model_len} must exceed --seq-length "
                f"{self.seq_length} (vLLM keeps one position for the sampled token)"
            )

    @property
    def resolved_max_num_seqs(self) -> int:
        return self.max_num_seqs if self.max_num_seqs is not None else max(32, self.batch_size)

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len if self.max_model_len is not None else self.seq_length + 1


@dataclass
class DatagenSummary:
    output_dir: str
    samples_total: int  # in this shard
    samples_written: int
    samples_already_present: int
    tokens_extracted: int
    seconds: float  # the whole run: preprocessing, engine start, extraction, writing
    extraction_seconds: float  # from the first generate() call to the last file written
    skipped_rows: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Extraction throughput, files written included (engine start-up excluded)."""
        if self.extraction_seconds <= 0:
            return 0.0
        return self.tokens_extracted / self.extraction_seconds

    def describe(self) -> str:
        return (
            f"{self.samples_written} samples written ({self.samples_already_present} already "
            f"present) of {self.samples_total} in this shard; {self.tokens_extracted} tokens "
            f"extracted in {self.extraction_seconds:.1f} s = {self.tokens_per_second:.0f} "
            f"tokens/s ({self.seconds:.1f} s in all); data in {self.output_dir}"
        )


def shard_positions(num_rows: int, num_shards: int, shard_index: int) -> list[int]:
    """Rows of one shard: every `num_shards`-th row from `shard_index` (lengths stay balanced)."""
    return list(range(shard_index, num_rows, num_shards))


def _run_identity(options: DatagenOptions, facts: ModelFacts, digest: str) -> RunIdentity:
    data = Path(options.train_data_path)
    return RunIdentity(
        compared={
            "target_model_path": facts.path,
            "layer_ids": facts.layer_ids,
            "dtype": options.dtype,
            "output_format": options.output_format,
            "start_idx": options.start_idx,
            "num_shards": options.num_shards,
            "samples_sha256": digest,
        },
        informational={
            "train_data": str(data.resolve()) if data.exists() else options.train_data_path,
            "seq_length": options.seq_length,
            "seed": options.seed,
            "max_samples": options.max_samples,
            "assistant_pattern": options.assistant_pattern,
            "turn_dropout": options.turn_dropout,
        },
    )


def _write_json_atomic(path: Path, payload: dict) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(payload, indent=2))
    os.replace(temp, path)


def _prepare_output_dir(output_dir: Path) -> bool:
    """Create the folder (refusing a file or an unwritable place); True if it was created here."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output-dir {output_dir} is a file; name a folder")
    created = not output_dir.exists()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"cannot create --output-dir {output_dir} ({error.strerror}); choose a writable place"
        ) from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--output-dir {output_dir} is not writable; choose a writable place")
    return created


def preprocess_samples(options: DatagenOptions, facts: ModelFacts) -> PreprocessResult:
    """The chat data as datagen samples (row i is sample `start_idx + i`), and rows dropped."""
    from speculators_vllm016.data_generation.preprocessing import load_and_preprocess

    return load_and_preprocess(
        target_model_path=facts.path,
        train_data_path=options.train_data_path,
        seq_length=options.seq_length,
        build_dataset_num_proc=options.num_preprocessing_workers,
        seed=options.seed,
        max_samples=options.max_samples,
        token_freq_path=None,
        cache_dir=options.hf_cache_dir,
        assistant_pattern=options.assistant_pattern,
        turn_dropout=options.turn_dropout,
        trust_remote_code=options.trust_remote_code,
    )


def start_generator(options: DatagenOptions, facts: ModelFacts, generator_class=None):
    """The hidden-states generator these options describe (the remote-code ask made readable)."""
    if generator_class is None:
        from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
            VllmHiddenStatesGenerator as generator_class,
        )
    try:
        return generator_class(
            model_path=facts.path,
            layer_ids=facts.layer_ids,
            max_model_len=options.resolved_max_model_len,
            gpu_memory_utilization=options.gpu_memory_utilization,
            tensor_parallel_size=options.tensor_parallel_size,
            pipeline_parallel_size=options.pipeline_parallel_size,
            dtype=options.dtype,
            max_num_seqs=options.resolved_max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            trust_remote_code=options.trust_remote_code,
            transfer_root=options.transfer_root,
        )
    except Exception as error:  # noqa: BLE001 - translated when it is the remote-code ask
        hint = remote_code_hint(error, options.target_model_path)
        if hint is not None:
            raise hint from None
        raise


def run_datagen(options: DatagenOptions) -> DatagenSummary:
    """Run (or resume) one shard of a datagen job; returns what was done.

    Every check that needs no engine runs before anything is written. A folder this call created
    is removed again when the run fails before writing a sample.
    """
    options.validate()
    facts = inspect_model(options.target_model_path, options.layer_ids, options.trust_remote_code)
    check_transfer_space(options, facts)
    started = time.perf_counter()
    output_dir = Path(options.output_dir)
    created = _prepare_output_dir(output_dir)
    try:
        with ShardLock(output_dir, options.shard_index, options.num_shards), WriterSlot(
            output_dir
        ) as slot:
            return _run_locked(options, facts, output_dir, slot, started)
    except BaseException:
        if created and not has_sample_files(output_dir):
            shutil.rmtree(output_dir, ignore_errors=True)
        raise


class ShardLock:
    """Held for a whole run: a second process on the same shard of one folder is refused."""

    def __init__(self, output_dir: Path, shard_index: int, num_shards: int) -> None:
        folder = output_dir / LOCK_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"shard-{shard_index}-of-{num_shards}.lock"
        self._fd: int | None = None

    def __enter__(self) -> ShardLock:
        self._fd = _try_lock(self.path)
        if self._fd is None:
            raise ValueError(
                f"another datagen process is running shard {self.path.stem} in "
                f"{self.path.parent.parent}; wait for it, or give this one another --shard-index"
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_token_counts(options: DatagenOptions, dataset, positions: list[int]) -> None:
    """This shard's counts beside the data, and where --token-freq-path asks (0.3.0's file)."""
    from speculators_vllm016.train.vocab_mapping import count_trained_tokens

    counts = dict(count_trained_tokens(dataset.select(positions)))
    own = save_token_counts(
        counts, shard_token_freq_path(options.output_dir, options.shard_index, options.num_shards)
    )
    logger.info("token counts of this shard: %s", own)
    if options.token_freq_path:
        path = Path(options.token_freq_path)
        if options.num_shards > 1:
            path = path.with_name(
                f"{path.stem}.shard-{options.shard_index}-of-{options.num_shards}{path.suffix}"
            )
        save_token_counts(counts, path)
        logger.info("token counts also in %s", path)


def _run_locked(
    options: DatagenOptions, facts: ModelFacts, output_dir: Path, slot: WriterSlot, started: float
) -> DatagenSummary:
    from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator,
    )

    removed = remove_partial_files(output_dir)
    if removed:
        logger.info("removed %d partial files left by an interrupted run", removed)
    refuse_unrecorded(output_dir, options.adopt_existing)  # before the preprocessing it would waste

    preprocessed = preprocess_samples(options, facts)
    dataset, skipped_rows = preprocessed.dataset, preprocessed.skipped_rows
    identity = _run_identity(options, facts, samples_digest(dataset))
    must_record = check_identity(output_dir, identity, options.adopt_existing)

    positions = shard_positions(len(dataset), options.num_shards, options.shard_index)
    _write_token_counts(options, dataset, positions)
    manifest = ManifestWriter(
        manifest_path(output_dir, options.shard_index, options.num_shards), fsync=options.fsync
    )
    try:
        return _extract_shard(
            options, facts, dataset, positions, output_dir, slot, manifest, identity,
            must_record, started, skipped_rows, VllmHiddenStatesGenerator,
        )
    finally:
        manifest.close()


def _extract_shard(
    options, facts, dataset, positions, output_dir, slot, manifest, identity, must_record,
    started, skipped_rows, generator_class,
) -> DatagenSummary:
    on_disk = existing_sample_indices(output_dir, options.output_format)
    candidates = (
        (
            options.start_idx + position,
            sample_path(output_dir, options.start_idx + position, options.output_format).name,
            torch.as_tensor(dataset[position]["input_ids"], dtype=torch.long),
        )
        for position in positions
        if options.start_idx + position in on_disk
    )
    present = verify_present(
        output_dir, candidates, read_manifest(output_dir), len(facts.layer_ids), manifest
    )
    batches = [
        positions[i : i + options.batch_size] for i in range(0, len(positions), options.batch_size)
    ]
    todo = [
        batch
        for batch in batches
        if any(options.start_idx + position not in present for position in batch)
    ]
    already = sum(1 for position in positions if options.start_idx + position in present)
    logger.info(
        "shard %d/%d: %d samples, %d already on disk, %d batches to run",
        options.shard_index, options.num_shards, len(positions), already, len(todo),
    )

    written = 0
    tokens = 0
    extraction_seconds = 0.0
    generator = None
    try:
        if todo:
            generator = start_generator(options, facts, generator_class)
        if must_record:  # the run is known to start: a typo never locks the folder
            record_identity(output_dir, identity)
        if generator is not None:
            extraction_started = time.perf_counter()
            totals = extract_and_write(
                generator,
                _sample_requests(dataset, todo, present, options.start_idx),
                output_dir,
                options.output_format,
                batch_size=options.batch_size,
                num_writer_threads=options.num_writer_threads,
                fsync=options.fsync,
                slot=slot,
                manifest=manifest,
                total=sum(len(batch) for batch in todo),
                show_progress=options.show_progress,
            )
            written, tokens = totals.samples_written, totals.tokens_extracted
            extraction_seconds = time.perf_counter() - extraction_started
        config = _data_config(generator, options, len(dataset))
        if config is not None:
            _write_json_atomic(output_dir / CONFIG_FILE, config)
    finally:
        if generator is not None:
            generator.close()
    return DatagenSummary(
        output_dir=str(output_dir),
        samples_total=len(positions),
        samples_written=written,
        samples_already_present=already,
        tokens_extracted=tokens,
        seconds=time.perf_counter() - started,
        extraction_seconds=extraction_seconds,
        skipped_rows=skipped_rows,
    )


def _data_config(generator, options: DatagenOptions, num_samples: int) -> dict | None:
    from datasets import config as datasets_config

    from speculators_vllm016.data_generation.config_generator import DataGenerationConfig

    if generator is None:
        return None  # nothing ran: the config written by the run that made the files stands
    config = DataGenerationConfig.from_generator(
        generator=generator,
        train_data_path=options.train_data_path,
        seq_length=options.seq_length,
        cache_dir=str(options.hf_cache_dir or datasets_config.HF_DATASETS_CACHE),
        num_samples=num_samples,
        max_samples=options.max_samples,
        seed=options.seed,
        file_pattern=SAMPLE_PATTERNS[options.output_format],
    )
    return config.to_dict()


class SampleWriterPool:
    """Writes samples on worker threads while extraction goes on.

    At most `max_pending` samples wait for a writer: beyond that, `submit` waits for the oldest,
    so memory stays bounded when the disk is slower than the engine.
    """

    def __init__(
        self,
        num_threads: int,
        output_format: str,
        fsync: bool = False,
        max_pending: int = 64,
        slot: WriterSlot | None = None,
        manifest: ManifestWriter | None = None,
    ) -> None:
        self.output_format = output_format
        self.fsync = fsync
        self.slot = slot
        self.manifest = manifest
        self.max_pending = max(1, max_pending)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="sample-writer")
        self._pending: deque[Future] = deque()
        self.written = 0

    def _write(self, path: Path, sample: dict, index: int) -> WrittenFile:
        written = write_sample_file(path, sample, self.output_format, self.fsync, self.slot)
        if self.manifest is not None:  # the file is whole under its name: now it is listed
            length = int(torch.as_tensor(sample["input_ids"]).numel())
            self.manifest.append(
                SampleRecord(path.name, index, length, written.bytes, written.sha256)
            )
        return written

    def submit(self, path: Path, sample: dict, index: int = -1) -> None:
        self._pending.append(self._pool.submit(self._write, path, sample, index))
        while len(self._pending) > self.max_pending:
            self._collect_oldest()

    def _collect_oldest(self) -> None:
        self._pending.popleft().result()
        self.written += 1

    def drain(self) -> None:
        """Wait for every write submitted so far; re-raise the first failure."""
        while self._pending:
            self._collect_oldest()

    def finish(self) -> int:
        """Wait for every write; re-raise the first failure. Returns samples written."""
        try:
            while self._pending:
                self._collect_oldest()
        finally:
            self._pool.shutdown(wait=True)
        return self.written

    def __enter__(self) -> SampleWriterPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


@dataclass(frozen=True)
class SampleRequest:
    """One sequence to extract, and the sample file it becomes."""

    index: int  # the file's sample index (`sample_path(folder, index, format)`)
    input_ids: list[int]
    loss_mask: torch.Tensor  # long, one per token: stored as the sample's `loss_mask`
    write: bool = True  # False: extracted only so its batch runs whole (its file is on disk)


@dataclass(frozen=True)
class StreamTotals:
    samples_written: int
    tokens_extracted: int  # every extracted token, those of samples not written included


def extract_and_write(
    generator,
    batches: Iterable[Sequence[SampleRequest]],
    output_dir: str | Path,
    output_format: str,
    *,
    batch_size: int,
    num_writer_threads: int = 4,
    fsync: bool = False,
    slot: WriterSlot | None = None,
    manifest: ManifestWriter | None = None,
    total: int | None = None,
    show_progress: bool = True,
) -> StreamTotals:
    """Datagen's extraction loop: each batch through `generate_stream`, every finished sample
    handed at once to writer threads, so extraction of the rest overlaps the writing.

    The one loop both `speculators datagen` and the extraction benchmark run. Files are written
    atomically (`write_sample_file`); on an exception, the writes already submitted finish
    before it propagates, so only whole files remain. At most `2 * batch_size` samples wait for
    a writer (memory stays bounded on a slow disk); `total` sizes the progress bar.
    """
    output_dir = Path(output_dir)
    progress = tqdm(total=total, unit="sample", desc="Extracting", disable=not show_progress)
    tokens = 0
    clock = time.perf_counter()
    try:
        with SampleWriterPool(
            num_writer_threads,
            output_format,
            fsync=fsync,
            max_pending=2 * batch_size,
            slot=slot,
            manifest=manifest,
        ) as writers:
            for batch in batches:
                for offset, result in generator.generate_stream([r.input_ids for r in batch]):
                    request = batch[offset]
                    tokens += len(request.input_ids)
                    progress.update(1)
                    if request.write:
                        sample = {
                            "input_ids": result.input_ids,
                            "hidden_states": result.hidden_states,
                            "loss_mask": request.loss_mask,
                        }
                        writers.submit(
                            sample_path(output_dir, request.index, output_format),
                            sample,
                            request.index,
                        )
                    elapsed = max(time.perf_counter() - clock, 1e-9)
                    progress.set_postfix(tokens_per_s=f"{tokens / elapsed:.0f}", refresh=False)
    finally:
        progress.close()
    return StreamTotals(samples_written=writers.written, tokens_extracted=tokens)


def _sample_requests(
    dataset, todo: list[list[int]], present: set[int], start_idx: int
) -> Iterator[list[SampleRequest]]:
    """The batches still to run as requests, read from the dataset one batch at a time."""
    for batch in todo:
        rows = dataset.select(batch)
        yield [
            SampleRequest(
                index=start_idx + position,
                input_ids=torch.as_tensor(ids).tolist(),
                loss_mask=torch.as_tensor(mask, dtype=torch.long),
                write=start_idx + position not in present,
            )
            for position, ids, mask in zip(batch, rows["input_ids"], rows["loss_mask"])
        ]


def summary_json(summary: DatagenSummary) -> str:
    payload = asdict(summary)
    payload["tokens_per_second"] = round(summary.tokens_per_second, 1)
    return json.dumps(payload)

