"""The offline data-generation run: chat data -> hidden-state sample files.

dataset -> preprocessing -> this shard's samples -> generator (vLLM) -> writer threads -> files.
Extraction of batch k+1 overlaps the writing of batch k. A run resumes where a crash left it:
only the samples whose files are missing (or fail their check) are computed, in batches of their
own; a sample's hidden states do not depend on its batch, so the folder equals an uninterrupted
run's file by file.

The parts live in their own modules: the options (`options`), the folder protocol
(`output_folder`), the writer pool (`sample_writers`) and the extraction loop (`extraction`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from speculators_vllm016.data_generation.extraction import (
    extract_and_write,
    sample_requests,
)
from speculators_vllm016.data_generation.folder_kinds import refuse_other_command_folder
from speculators_vllm016.data_generation.manifest import read_manifest
from speculators_vllm016.data_generation.options import (
    DatagenOptions,
)
from speculators_vllm016.data_generation.output_folder import (
    DatagenFolder,
)
from speculators_vllm016.data_generation.preflight import ModelFacts, inspect_model
from speculators_vllm016.data_generation.resume import (
    RunIdentity,
    has_sample_files,
    run_identity,
    samples_digest,
    verify_present,
)
from speculators_vllm016.data_generation.sample_io import (
    existing_sample_indices,
    sample_path,
)
from speculators_vllm016.data_generation.token_counts import count_trained_tokens
from speculators_vllm016.data_generation.transfer import check_transfer_space
from speculators_vllm016.utils.eagle3_serving import target_identity, target_serving_line
from speculators_vllm016.utils.verifier_config import remote_code_hint

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.preprocessing import PreprocessResult

__all__ = [
    "DatagenSummary",
    "ShardExtraction",
    "preprocess_samples",
    "run_datagen",
    "shard_positions",
    "start_generator",
]

logger = logging.getLogger(__name__)


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
        skipped = f" ({self.skipped_rows} unusable chat rows skipped)" if self.skipped_rows else ""
        return (
            f"{self.samples_written} samples written ({self.samples_already_present} already "
            f"present) of {self.samples_total}{skipped} in this shard; {self.tokens_extracted} tokens "
            f"extracted in {self.extraction_seconds:.1f} s = {self.tokens_per_second:.0f} "
            f"tokens/s ({self.seconds:.1f} s in all); data in {self.output_dir}"
        )


def shard_positions(num_rows: int, num_shards: int, shard_index: int) -> list[int]:
    """Rows of one shard: every `num_shards`-th row from `shard_index` (lengths stay balanced)."""
    return list(range(shard_index, num_rows, num_shards))


def preprocess_samples(options: DatagenOptions, facts: ModelFacts) -> PreprocessResult:
    """The chat data as datagen samples (row i is sample `start_idx + i`), and rows dropped."""
    from speculators_vllm016.data_generation.preprocessing import load_and_preprocess

    data = options.preprocessing
    return load_and_preprocess(
        target_model_path=facts.path,
        train_data_path=data.train_data_path,
        seq_length=data.seq_length,
        build_dataset_num_proc=data.num_preprocessing_workers,
        seed=data.seed,
        max_samples=data.max_samples,
        token_freq_path=None,
        cache_dir=data.hf_cache_dir,
        assistant_pattern=data.assistant_pattern,
        turn_dropout=data.turn_dropout,
        trust_remote_code=options.engine.trust_remote_code,
        chat_template_kwargs=data.template_kwargs(),
        session_tokens=data.session_tokens,
        sessions_only=data.sessions_only,
    )


def start_generator(options: DatagenOptions, facts: ModelFacts, generator_class=None):
    """The hidden-states generator these options describe (the remote-code ask made readable)."""
    if generator_class is None:
        from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
            VllmHiddenStatesGenerator as generator_class,
        )
    engine = options.engine
    try:
        return generator_class(
            model_path=facts.path,
            layer_ids=facts.layer_ids,
            max_model_len=options.resolved_max_model_len,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            dtype=engine.dtype,
            max_num_seqs=options.resolved_max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            trust_remote_code=engine.trust_remote_code,
            transfer_root=engine.transfer_root,
            target_config=facts.config_dict,  # read by `inspect_model`, not again
        )
    except Exception as error:  # noqa: BLE001 - translated when it is the remote-code ask
        hint = remote_code_hint(error, engine.target_model_path)
        if hint is not None:
            raise hint from None
        raise


def run_datagen(
    options: DatagenOptions, generator: Any = None, facts: ModelFacts | None = None
) -> DatagenSummary:
    """Run (or resume) one shard of a datagen job; returns what was done.

    Every check that needs no engine runs before anything is written. A folder this call created
    is removed again when the run fails before writing a sample. `generator`: an engine already
    started for these options (`datagen --regenerate` generated with it); the caller closes it.
    `facts`: the target as the caller read it for these options (`inspect_model`): the one
    reading of its config.json every check and the engine's start use; None: read here.
    """
    options.validate()
    engine, output = options.engine, options.output
    if facts is None:
        facts = inspect_model(engine.target_model_path, output.layer_ids, engine.trust_remote_code)
    check_transfer_space(options, facts)
    logger.info(target_serving_line(*target_identity(facts.config_dict)))
    started = time.perf_counter()
    folder = DatagenFolder(
        output.output_dir,
        shard_index=output.shard_index,
        num_shards=output.num_shards,
        fsync=output.fsync,
    )
    refuse_other_command_folder(output.output_dir, "--output-dir", "datagen")
    created = folder.prepare()
    try:
        with folder:
            folder.lock()
            folder.open_slot()
            return _run_locked(options, facts, folder, started, generator)
    except BaseException:
        if created and not has_sample_files(folder.path):
            shutil.rmtree(folder.path, ignore_errors=True)
        raise


def _run_locked(
    options: DatagenOptions,
    facts: ModelFacts,
    folder: DatagenFolder,
    started: float,
    generator: Any = None,
) -> DatagenSummary:
    from speculators_vllm016.data_generation.vllm_hidden_states_generator import (
        VllmHiddenStatesGenerator,
    )

    output = options.output
    folder.refuse_unrecorded(output.adopt_existing)  # before the preprocessing it would waste

    preprocessed = preprocess_samples(options, facts)
    dataset = preprocessed.dataset
    identity = run_identity(options, facts, samples_digest(dataset), len(dataset))
    must_record = folder.check_identity(identity, output.adopt_existing)

    positions = shard_positions(len(dataset), output.num_shards, output.shard_index)
    counts = dict(count_trained_tokens(dataset.select(positions)))
    folder.write_token_counts(counts, also_to=output.token_freq_path)
    folder.open_manifest()
    return ShardExtraction(
        options=options,
        facts=facts,
        dataset=dataset,
        positions=positions,
        folder=folder,
        identity=identity,
        must_record=must_record,
        started=started,
        skipped_rows=preprocessed.skipped_rows,
        generator_class=VllmHiddenStatesGenerator,
        started_generator=generator,
    ).run()


@dataclass
class ShardExtraction:
    """What is left of one shard's extraction in a held folder, and running it.

    Present files that check out are kept; only the missing samples run, once the started
    engine is known to make tensors like the kept files' (its dtype and width). The run is
    recorded in the folder once the engine started (a typo never locks the folder), and
    `data_config.json` is written when an engine ran.
    """

    options: DatagenOptions
    facts: ModelFacts
    dataset: Any  # datasets.Dataset of the preprocessed samples; row p is sample start_idx + p
    positions: list[int]  # this shard's rows
    folder: DatagenFolder  # locked, with a writer slot and an open manifest
    identity: RunIdentity
    must_record: bool  # the folder holds no record of this run yet
    started: float  # perf_counter() at the run's start, for the summary
    skipped_rows: int = 0  # chat rows preprocessing dropped
    generator_class: Any = None  # None: VllmHiddenStatesGenerator
    started_generator: Any = None  # one the caller started (and closes); None: start one
    # (dtype, width) of the kept files' hidden states -> one file of each (`present` fills it)
    kept_signatures: dict = field(default_factory=dict)

    def present(self) -> set[int]:
        """Indices of this shard whose files are on disk and hold the expected sample."""
        output, dataset = self.options.output, self.dataset
        on_disk = existing_sample_indices(self.folder.path, output.output_format)
        candidates = (
            (
                output.start_idx + position,
                sample_path(
                    self.folder.path, output.start_idx + position, output.output_format
                ).name,
                torch.as_tensor(dataset[position]["input_ids"], dtype=torch.long),
            )
            for position in self.positions
            if output.start_idx + position in on_disk
        )
        return verify_present(
            self.folder.path,
            candidates,
            read_manifest(self.folder.path),
            len(self.facts.layer_ids),
            self.folder.manifest,
            self.kept_signatures,
        )

    def run(self) -> DatagenSummary:
        options, output, folder = self.options, self.options.output, self.folder
        positions, start = self.positions, output.start_idx
        present = self.present()
        # Only the missing samples reach the engine, batched anew: a sample's hidden states do
        # not depend on the others in its batch (the test compares a resumed folder bit for bit).
        missing = [position for position in positions if start + position not in present]
        todo = [
            missing[i : i + output.batch_size] for i in range(0, len(missing), output.batch_size)
        ]
        already = len(positions) - len(missing)
        logger.info(
            "shard %d/%d: %d samples, %d already on disk, %d to compute",
            output.shard_index,
            output.num_shards,
            len(positions),
            already,
            len(missing),
        )

        written = 0
        tokens = 0
        extraction_seconds = 0.0
        generator = None
        try:
            if todo:
                generator = self.started_generator or start_generator(
                    options, self.facts, self.generator_class
                )
                # Kept files made otherwise (another dtype) would leave the folder mixed.
                folder.refuse_other_tensors(
                    self.kept_signatures, getattr(generator, "dtype", None), self.facts.hidden_size
                )
            if self.must_record:  # the run is known to start: a typo never locks the folder
                folder.record_identity(self.identity)
            if generator is not None:
                extraction_started = time.perf_counter()
                totals = extract_and_write(
                    generator,
                    sample_requests(self.dataset, todo, present, start),
                    folder.path,
                    output.output_format,
                    batch_size=output.batch_size,
                    num_writer_threads=output.num_writer_threads,
                    fsync=output.fsync,
                    slot=folder.slot,
                    manifest=folder.manifest,
                    total=sum(len(batch) for batch in todo),
                    show_progress=output.show_progress,
                    storage_dtype=output.storage_dtype,
                )
                written, tokens = totals.samples_written, totals.tokens_extracted
                extraction_seconds = time.perf_counter() - extraction_started
            folder.write_data_config(generator, options, len(self.dataset), self.facts.config_dict)
        finally:
            if generator is not None and generator is not self.started_generator:
                generator.close()
        return DatagenSummary(
            output_dir=str(folder.path),
            samples_total=len(positions),
            samples_written=written,
            samples_already_present=already,
            tokens_extracted=tokens,
            seconds=time.perf_counter() - self.started,
            extraction_seconds=extraction_seconds,
            skipped_rows=self.skipped_rows,
        )


def summary_json(summary: DatagenSummary) -> str:
    payload = asdict(summary)
    payload["tokens_per_second"] = round(summary.tokens_per_second, 1)
    return json.dumps(payload)
