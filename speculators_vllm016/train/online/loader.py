"""Online training: the target model extracts hidden states while the draft trains on them.

    chat data -> datagen's preprocessing -> samples (index = datagen's file index)
    sampler (the offline plan) -> producer thread: generator.generate_stream(samples of the next
    steps) -> bounded queue of rows -> trainer (main thread: prepare_sample + collate, as offline)

The rows equal what offline training reads from datagen's files of the same samples: the same
split (`split_items` over the indices, in datagen's file order), the same sampler, the same
per-sample preparation (`Eagle3SampleFileDataset.prepare`, noise seeded per sample), and the
generator's tensors are the ones datagen writes. Noise and packing run on the main thread, so the
process RNG is never touched by the producer.

`cache_dir` (hybrid mode) writes every extracted sample with datagen's writer (atomic files,
manifest, run identity, token counts, `data_config.json`): a normal datagen folder. An epoch whose
samples are all in it reads them and starts no engine (a running one is closed).

vLLM is imported only when an engine starts; this module imports none of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speculators_vllm016.train.data import (
    DataSourceError,
    Eagle3SampleFileDataset,
    PackedBatch,
    SampleFileError,
)
from speculators_vllm016.train.loading.loader_contract import ReportsProgress, TrainingLoader
from speculators_vllm016.train.online.errors import (
    CacheFolderError,
    CacheOfOtherTensors,
    CacheWriteFailed,
    ExtractionFailed,
)
from speculators_vllm016.utils.errors import first_line, type_and_first_line

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.data_generation.preflight import ModelFacts

__all__ = [
    "PRODUCER_END",
    "OnlineExtractor",
    "OnlineLoader",
    "OnlineStats",
    "ProducerFailure",
    "SampleExchange",
    "as_source_error",
]

logger = logging.getLogger(__name__)

PRODUCER_END = object()  # the producer's last item: every step was put


@dataclass
class ProducerFailure:
    """What the producer thread puts in its queue when extraction failed (then it stops)."""

    error: BaseException


@dataclass
class OnlineStats:
    """Rates and waits of both sides, for the progress bar."""

    extracted_tokens: int = 0
    extraction_seconds: float = 0.0  # inside generate_stream
    trainer_wait: float = 0.0  # the trainer waited for rows
    producer_wait: float = 0.0  # the producer waited for room in the queue
    engine_starts: int = 0
    cached_reads: int = 0
    extracted_samples: int = 0

    def fields(self) -> dict[str, str]:
        rate = self.extracted_tokens / self.extraction_seconds if self.extraction_seconds else 0.0
        waiting = "trainer" if self.trainer_wait > self.producer_wait else "extractor"
        return {"ext_tok_s": f"{rate:,.0f}", "waits": waiting}


@dataclass
class _Producer:
    thread: threading.Thread
    stop: threading.Event
    rows: queue.Queue = field(repr=False)


class OnlineExtractor:
    """Owns the (lazily started) generator, the optional cache folder, and the samples.

    `dataset` is datagen's preprocessed dataset (`preprocess_samples`); sample `start_idx + p`
    is row `p`. One producer runs at a time; `close()` stops it, the engine and the writers.
    """

    def __init__(
        self,
        options: DatagenOptions,
        facts: ModelFacts,
        dataset: Any,
        cache_dir: Path | None,
        engine_devices: str | None = None,
        writes_cache: bool = True,
        cache_shard: tuple[int, int] = (0, 1),
    ) -> None:
        self.options = options
        self.engine_devices = engine_devices  # CUDA_VISIBLE_DEVICES of the engine (--train-devices)
        self.facts = facts
        self.dataset = dataset
        self.cache_dir = cache_dir
        self.generator: Any = None
        self.stats = OnlineStats()
        self._producer: _Producer | None = None
        # Under torchrun only rank 0 (the one running the engine) writes the cache folder.
        self._cache: _Cache | None = (
            _Cache(options, facts, dataset, cache_dir, cache_shard)
            if cache_dir and writes_cache
            else None
        )

    # -- samples -------------------------------------------------------------------------------
    @property
    def indices(self) -> list[int]:
        """Every sample's datagen index, in datagen's file order."""
        return [self.options.output.start_idx + position for position in range(len(self.dataset))]

    def sample_path(self, index: int) -> Path:
        from speculators_vllm016.data_generation.sample_io import sample_path

        folder = self.cache_dir if self.cache_dir is not None else Path("<online>")
        return sample_path(folder, index, self.options.output.output_format)

    def lengths(self, indices: list[int]) -> list[int]:
        """Shifted lengths (tokens - 1), what the sampler packs."""
        ids = self.dataset["input_ids"]
        return [max(len(ids[index - self.options.output.start_idx]) - 1, 0) for index in indices]

    def cached(self) -> set[int]:
        return self._cache.complete() if self._cache is not None else set()

    # -- the engine ----------------------------------------------------------------------------
    def ensure_engine(self) -> None:
        """Start the target model's engine (main thread) unless it runs."""
        if self.generator is not None:
            return
        from speculators_vllm016.data_generation.offline import start_generator
        from speculators_vllm016.train.jobs.devices import (
            engine_visible_devices,
            launcher_variables_hidden,
        )

        logger.info("starting the target model's engine for online extraction")
        if self.engine_devices is not None and torch.cuda.is_available():
            torch.cuda.init()  # the trainer's own view of the GPUs is fixed before the engine's is set
        with engine_visible_devices(self.engine_devices), launcher_variables_hidden():
            self.generator = start_generator(self.options, self.facts)
        self.stats.engine_starts += 1
        if self._cache is not None:
            self._cache.started(self.generator)

    def stop_engine(self) -> None:
        self.stop_producer()
        if self.generator is not None:
            self.generator.close()
            self.generator = None

    def extract(self, indices: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """`(k, raw sample)` for `indices[k]` as the engine finishes them; cached if asked."""
        assert self.generator is not None
        positions = [index - self.options.output.start_idx for index in indices]
        rows = self.dataset.select(positions)
        input_ids = [torch.as_tensor(ids).tolist() for ids in rows["input_ids"]]
        masks = rows["loss_mask"]
        clock = time.perf_counter()
        stream = self.generator.generate_stream(input_ids)
        try:
            for k, result in stream:
                self.stats.extraction_seconds += time.perf_counter() - clock
                sample = {
                    "input_ids": result.input_ids,
                    "hidden_states": result.hidden_states,
                    "loss_mask": torch.as_tensor(masks[k], dtype=torch.long),
                }
                self.stats.extracted_tokens += len(input_ids[k])
                self.stats.extracted_samples += 1
                if self._cache is not None:
                    sample = self._cache.write(indices[k], sample)
                yield k, sample
                clock = time.perf_counter()
        finally:
            stream.close()

    # -- the producer --------------------------------------------------------------------------
    def start_producer(
        self, steps: list[list[int]], names: list[int], need: set[int], queue_size: int
    ) -> _Producer:
        """Extract the samples of `steps` (dataset positions; `names[i]` is i's datagen index)."""
        self.stop_producer()
        producer = _Producer(
            thread=threading.Thread(target=lambda: None),
            stop=threading.Event(),
            rows=queue.Queue(maxsize=max(1, queue_size)),
        )
        producer.thread = threading.Thread(
            target=self._produce,
            args=(steps, names, need, producer),
            name="online-extraction",
            daemon=True,
        )
        self._producer = producer
        producer.thread.start()
        return producer

    def stop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        producer.stop.set()
        while producer.thread.is_alive():
            try:  # make room so a blocked put returns
                producer.rows.get_nowait()
            except queue.Empty:
                pass
            producer.thread.join(timeout=0.1)

    def _put(self, producer: _Producer, item: Any) -> bool:
        started = time.perf_counter()
        while not producer.stop.is_set():
            try:
                producer.rows.put(item, timeout=0.1)
                self.stats.producer_wait += time.perf_counter() - started
                return True
            except queue.Full:
                continue
        return False

    def _produce(
        self, steps: list[list[int]], names: list[int], need: set[int], producer: _Producer
    ) -> None:
        chunk = max(1, self.options.resolved_max_num_seqs)
        try:
            start = 0
            while start < len(steps):
                # The next steps whose samples fill one engine call.
                end, todo = start, []
                while end < len(steps) and (end == start or len(todo) < chunk):
                    todo += [item for item in steps[end] if item in need]
                    end += 1
                ready: dict[int, dict] = {}
                emitted = start

                def emit_ready(end: int = end, ready: dict[int, dict] = ready) -> bool:
                    nonlocal emitted
                    while emitted < end and all(
                        item in ready or item not in need for item in steps[emitted]
                    ):
                        row = {item: ready.pop(item) for item in steps[emitted] if item in need}
                        if not self._put(producer, row):
                            return False
                        emitted += 1
                    return True

                if todo:
                    for k, sample in self.extract([names[item] for item in todo]):
                        ready[todo[k]] = sample
                        if not emit_ready() or producer.stop.is_set():
                            return
                if not emit_ready():
                    return
                start = end
            self._put(producer, PRODUCER_END)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            self._put(producer, ProducerFailure(error))

    def close(self) -> None:
        try:
            self.stop_engine()
        finally:
            if self._cache is not None:
                self._cache.close()
                self._cache = None


class _Cache:
    """Hybrid mode's cache: a datagen folder (`DatagenFolder`, one shard of one) named --cache-dir."""

    def __init__(
        self,
        options: DatagenOptions,
        facts: ModelFacts,
        dataset: Any,
        folder: Path,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        from speculators_vllm016.data_generation.output_folder import DatagenFolder, FolderInUse
        from speculators_vllm016.data_generation.resume import run_identity, samples_digest
        from speculators_vllm016.data_generation.sample_writers import SampleWriterPool
        from speculators_vllm016.data_generation.token_counts import count_trained_tokens

        self.options, self.folder = options, folder
        self.hidden_size = facts.hidden_size
        # Train has no --adopt-existing: a folder it cannot trust is refused outright.
        # Split online runs: extraction rank e of K writes shard e of K (and reads every shard).
        self._folder = DatagenFolder(
            folder,
            fsync=options.output.fsync,
            flag="--cache-dir",
            adopt_flag=None,
            shard_index=shard[0],
            num_shards=shard[1],
        )
        try:
            self._folder.prepare()
        except ValueError as error:
            raise CacheFolderError(first_line(error)) from None
        try:  # what set-up took is given back if a later part of it fails
            try:
                self._folder.lock()
            except FolderInUse as error:
                raise CacheFolderError(first_line(error)) from None
            except OSError as error:
                raise CacheFolderError(
                    f"cannot use --cache-dir {folder} ({error}); choose a writable folder"
                ) from None
            try:
                self._folder.open_slot()
                self.identity = run_identity(options, facts, samples_digest(dataset), len(dataset))
                try:
                    self._must_record = self._folder.check_identity(self.identity)
                except ValueError as error:
                    raise CacheFolderError(first_line(error)) from None
                # The counts are of the whole dataset: one shard holds them, or they would add up K times.
                self._folder.write_token_counts(
                    dict(count_trained_tokens(dataset)) if shard[0] == 0 else {}
                )
                manifest = self._folder.open_manifest()
            except OSError as error:
                raise CacheFolderError(
                    f"cannot write --cache-dir {folder} ({error}); free space there or choose "
                    "another --cache-dir"
                ) from None
            self._writers = SampleWriterPool(
                options.output.num_writer_threads,
                options.output.output_format,
                fsync=options.output.fsync,
                max_pending=64,
                slot=self._folder.slot,
                manifest=manifest,
                storage_dtype=options.output.storage_dtype,
            )
        except BaseException:
            self._folder.close()
            raise
        self._num_samples = len(dataset)

    def started(self, generator: Any) -> None:
        """The engine runs: check that it makes tensors like the cached ones (as datagen does),
        record the run and write `data_config.json`."""
        try:
            self._folder.refuse_other_tensors(
                self._folder.listed_signatures(),
                getattr(generator, "dtype", None),
                self.hidden_size,
            )
        except ValueError as error:
            raise CacheOfOtherTensors(first_line(error)) from None
        try:
            if self._must_record:
                self._folder.record_identity(self.identity)
                self._must_record = False
            self._folder.write_data_config(generator, self.options, self._num_samples)
        except OSError as error:
            raise CacheWriteFailed.of(self.folder, error) from error

    def write(self, index: int, sample: dict) -> dict:
        """Cache `sample`; returns what the file holds (fp8: dequantized, as a read gives)."""
        from speculators_vllm016.data_generation.sample_io import (
            dequantized_sample,
            quantized_sample,
            sample_path,
        )

        fp8 = self.options.output.storage_dtype == "fp8"
        stored = quantized_sample(sample) if fp8 else sample
        try:
            self._writers.submit(
                sample_path(self.folder, index, self.options.output.output_format), stored, index
            )
        except Exception as error:  # an earlier write of the pool failed
            raise CacheWriteFailed.of(self.folder, error) from error
        return dequantized_sample(stored) if fp8 else sample

    def complete(self) -> set[int]:
        """Indices whose files are whole and listed in the manifest (pending writes finished)."""
        from speculators_vllm016.data_generation.manifest import read_manifest

        try:
            self._writers.drain()
        except Exception as error:
            raise CacheWriteFailed.of(self.folder, error) from error
        found = set()
        for name, record in read_manifest(self.folder).items():
            path = self.folder / name
            if path.is_file() and path.stat().st_size == int(record.bytes):
                found.add(int(record.index))
        return found

    def close(self) -> None:
        try:
            self._writers.finish()
        except Exception as error:
            raise CacheWriteFailed.of(self.folder, error) from error
        finally:
            self._folder.close()


class SampleExchange:
    """Online training under torchrun: rank 0 extracts, every rank trains on its own batches.

    Why this design: the batches rank r trains on must equal what offline training with N ranks
    reads, and the distributed sampler already says which samples those are for every rank (its
    plan depends only on the lengths, the seed and the epoch, so any rank can compute any other
    rank's). One engine on rank 0 then extracts the union of all ranks' samples of each step, in
    step order, and scatters each rank its own samples; each rank prepares them (noise seeded per
    sample) and packs them itself, exactly as offline. One engine per rank would need the GPUs to
    be split N ways and N engine start-ups, and N copies of the target's weights; one engine
    keeps the target's memory and start-up cost as in single-process online training and needs
    no agreement on which rank extracts what. The transfer goes over a separate gloo group (CPU
    tensors, pickled), so it works beside NCCL and never mixes with the trainer's collectives.
    Cost: every hidden state passes through rank 0's memory and the gloo transfer.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # every rank calls this at the same point

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        box = [value]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def scatter(self, values: list[Any] | None) -> Any:
        """`values[r]` (given on rank 0) arrives on rank r."""
        box = [None]
        self._dist.scatter_object_list(
            box, values if self.rank == 0 else None, src=0, group=self.group
        )
        return box[0]


def _rank_plans(batch_sampler: Any, world_size: int) -> list[list[list[int]]]:
    """Every rank's remaining steps of this epoch, from copies of this rank's sampler."""
    plans = []
    for rank in range(world_size):
        plans.append([list(step) for step in batch_sampler.for_rank(rank)])
    return plans


def as_source_error(error: BaseException, extractor: OnlineExtractor) -> DataSourceError:
    """The producer's failure as the trainer reports it: a cache write failure says so."""
    if isinstance(error, DataSourceError):
        return error
    return ExtractionFailed(
        _failure_message(error, getattr(extractor.generator, "worker_died", False))
    )


def _failure_message(error: BaseException, died: bool) -> str:
    return (
        f"the target model's engine failed{': a worker process died' if died else ''} "
        f"({type_and_first_line(error)})"
    )


class OnlineLoader(TrainingLoader, ReportsProgress):
    """What the trainer needs of a DataLoader (`TrainingLoader`): `batch_sampler`, `dataset`,
    `len()`, iteration; and the extraction's figures for the progress bar.

    `dataset` is an `Eagle3SampleFileDataset` over the samples' (cache) file names, so cached
    samples are read exactly as offline; extracted ones go through the same `prepare`.
    """

    def __init__(
        self,
        extractor: OnlineExtractor,
        dataset: Eagle3SampleFileDataset,
        indices: list[int],
        batch_sampler: Any,
        collate_fn: Any,
        queue_size: int,
        exchange: SampleExchange | None = None,
    ) -> None:
        self.exchange = exchange  # torchrun: rank 0 extracts for every rank
        self.extractor = extractor
        self.dataset = dataset
        self.indices = indices  # dataset position -> datagen index
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.queue_size = queue_size

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def progress_fields(self) -> dict[str, str]:
        return self.extractor.stats.fields()

    def __iter__(self) -> Iterator[PackedBatch]:
        if self.exchange is not None:
            yield from self._iter_ranks(self.exchange)
            return
        steps = [list(step) for step in self.batch_sampler]
        if not steps:  # an empty plan: nothing to extract, the engine stays as it is
            return
        cached = self.extractor.cached()
        need = {item for step in steps for item in step if self.indices[item] not in cached}
        if not need:
            yield from self._from_cache(steps)
            return
        self._start_engine()
        producer = self.extractor.start_producer(steps, self.indices, need, self.queue_size)
        stats = self.extractor.stats
        try:
            for step in steps:
                started = time.perf_counter()
                got = producer.rows.get()
                stats.trainer_wait += time.perf_counter() - started
                if isinstance(got, ProducerFailure):
                    raise as_source_error(got.error, self.extractor) from got.error
                if got is PRODUCER_END:
                    raise ExtractionFailed("the extraction ended before the epoch's last step")
                samples = [self.dataset.item(item, got.get(item)) for item in step]
                yield self.collate_fn(samples)
        finally:
            self.extractor.stop_producer()

    def _start_engine(self) -> None:
        """Start the engine; one that fails to start is a `DataSourceError` like one that dies
        later, so the trainer handles both alike (a run replacing an earlier one leaves it)."""
        try:
            self.extractor.ensure_engine()
        except (DataSourceError, SampleFileError):
            raise
        except Exception as error:  # noqa: BLE001 - vLLM's start-up fails in many ways
            raise as_source_error(error, self.extractor) from error

    def _from_cache(self, steps: list[list[int]]) -> Iterator[PackedBatch]:
        """An epoch whose samples are all in the cache folder: no engine runs."""
        if self.extractor.generator is not None:
            logger.info("every sample of this epoch is in the cache: closing the engine")
            self.extractor.stop_engine()
        self.extractor.stats.cached_reads += sum(len(step) for step in steps)
        for step in steps:
            yield self.collate_fn([self.dataset[item] for item in step])

    def _iter_ranks(self, exchange: SampleExchange) -> Iterator[PackedBatch]:
        """Every rank: its own steps; rank 0 also runs the engine and scatters the samples."""
        plans = _rank_plans(self.batch_sampler, exchange.world_size)
        if not any(plans):  # every rank computes the same plans: all return here, or none
            return
        steps = plans[exchange.rank]
        cached: Any = None
        if exchange.rank == 0:
            try:
                cached = self.extractor.cached()
            except DataSourceError as error:  # every rank stops, not only rank 0
                cached = ProducerFailure(error)
        cached = exchange.broadcast(cached)
        if isinstance(cached, ProducerFailure):
            raise type(cached.error)(str(cached.error))
        union = [
            list(dict.fromkeys(item for plan in plans for item in plan[s]))
            for s in range(len(steps))
        ]
        need = {item for step in union for item in step if self.indices[item] not in cached}
        if not need:  # every rank reads its samples from the cache folder
            yield from self._from_cache(steps)
            return
        producer = None
        failed: ProducerFailure | None = None
        if exchange.rank == 0:
            try:
                self._start_engine()
            except (DataSourceError, SampleFileError) as error:  # every rank stops, not only rank 0
                failed = ProducerFailure(error)
            else:
                producer = self.extractor.start_producer(union, self.indices, need, self.queue_size)
        stats = self.extractor.stats
        try:
            for s, step in enumerate(steps):
                parts = None
                if failed is not None:
                    parts = [failed] * exchange.world_size
                elif producer is not None:
                    started = time.perf_counter()
                    got = producer.rows.get()
                    stats.trainer_wait += time.perf_counter() - started
                    if isinstance(got, ProducerFailure) or got is PRODUCER_END:
                        error = (
                            as_source_error(got.error, self.extractor)
                            if isinstance(got, ProducerFailure)
                            else ExtractionFailed(
                                "the extraction ended before the epoch's last step"
                            )
                        )
                        parts = [ProducerFailure(error)] * exchange.world_size
                    else:
                        parts = [
                            {item: got[item] for item in plan[s] if item in got} for plan in plans
                        ]
                mine = exchange.scatter(parts)
                if isinstance(mine, ProducerFailure):
                    raise type(mine.error)(str(mine.error))
                yield self.collate_fn([self.dataset.item(item, mine.get(item)) for item in step])
        finally:
            if producer is not None:
                self.extractor.stop_producer()
