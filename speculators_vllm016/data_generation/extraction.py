"""Datagen's extraction loop: batches of samples through the engine, each finished one written.

The one loop both `speculators datagen` and the extraction benchmark run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from speculators_vllm016.data_generation.manifest import ManifestWriter
from speculators_vllm016.data_generation.sample_io import WriterSlot, sample_path
from speculators_vllm016.data_generation.sample_writers import SampleWriterPool

__all__ = ["SampleRequest", "StreamTotals", "extract_and_write", "sample_requests"]


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
    storage_dtype: str = "bf16",
) -> StreamTotals:
    """Each batch through `generate_stream`, every finished sample handed at once to writer
    threads, so extraction of the rest overlaps the writing.

    Files are written atomically (`write_sample_file`); on an exception, the writes already
    submitted finish before it propagates, so only whole files remain. At most `2 * batch_size`
    samples wait for a writer (memory stays bounded on a slow disk); `total` sizes the progress bar.
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
            storage_dtype=storage_dtype,
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


def sample_requests(
    dataset: Any, todo: list[list[int]], present: set[int], start_idx: int
) -> Iterator[list[SampleRequest]]:
    """The batches still to run (dataset rows) as requests, read one batch at a time; rows whose
    file is `present` are extracted (their batch runs whole) but not written."""
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
