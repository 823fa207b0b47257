"""`extract_and_write`, datagen's streaming loop, on a stand-in generator (no engine).

The engine-backed runs of this loop are in test_offline.py; here only its own logic: which
request a finished result belongs to, which samples are written, the totals, and that a failing
engine leaves only whole files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.extraction import SampleRequest, extract_and_write
from speculators_vllm016.data_generation.sample_io import (
    existing_sample_indices,
    load_sample,
    sample_path,
)
from speculators_vllm016.data_generation.vllm_hidden_states_generator import HiddenStatesResult

HIDDEN = 8
LAYERS = 2


def states_of(ids: list[int]) -> list[torch.Tensor]:
    """Hidden states that depend on the sequence, so a misattributed result shows."""
    seed = torch.Generator().manual_seed(sum(ids) * 31 + len(ids))
    return list(torch.randn(LAYERS, len(ids), HIDDEN, generator=seed).unbind(0))


class ReversedGenerator:
    """Finishes the sequences of each call last first, as an engine may; optionally dies."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.calls: list[list[list[int]]] = []

    def generate_stream(self, sequences):
        self.calls.append([list(ids) for ids in sequences])
        for offset in reversed(range(len(sequences))):
            if self.fail_after is not None:
                if self.fail_after == 0:
                    raise RuntimeError("engine worker died")
                self.fail_after -= 1
            ids = sequences[offset]
            yield (
                offset,
                HiddenStatesResult(
                    input_ids=torch.tensor(ids, dtype=torch.long), hidden_states=states_of(ids)
                ),
            )


def requests(count: int, skip: set[int] = frozenset()) -> list[SampleRequest]:
    out = []
    for index in range(count):
        ids = [index + 1] * (3 + index)
        mask = torch.tensor([index % 2] + [1] * (2 + index), dtype=torch.long)
        out.append(SampleRequest(100 + index, ids, mask, write=index not in skip))
    return out


@pytest.mark.parametrize("output_format", ["pt", "safetensors"])
def test_each_result_is_written_under_its_requests_index_with_its_mask(tmp_path, output_format):
    all_requests = requests(7, skip={1, 4})
    batches = [all_requests[:3], all_requests[3:6], all_requests[6:]]
    generator = ReversedGenerator()

    totals = extract_and_write(
        generator,
        batches,
        tmp_path,
        output_format,
        batch_size=3,
        num_writer_threads=2,
        show_progress=False,
    )

    # Whole batches run (skipped samples too), so every file equals an uninterrupted run's.
    assert generator.calls == [[r.input_ids for r in batch] for batch in batches]
    assert totals.samples_written == 5
    assert totals.tokens_extracted == sum(len(r.input_ids) for r in all_requests)
    assert existing_sample_indices(tmp_path, output_format) == {
        r.index for r in all_requests if r.write
    }
    for request in all_requests:
        if not request.write:
            continue
        sample = load_sample(sample_path(tmp_path, request.index, output_format))
        assert sample["input_ids"].tolist() == request.input_ids
        assert torch.equal(sample["loss_mask"], request.loss_mask)
        for got, want in zip(sample["hidden_states"], states_of(request.input_ids), strict=True):
            assert torch.equal(got, want)


def test_a_dying_engine_raises_and_leaves_only_whole_files(tmp_path):
    all_requests = requests(6)
    with pytest.raises(RuntimeError, match="engine worker died"):
        extract_and_write(
            ReversedGenerator(fail_after=4),
            [all_requests[:3], all_requests[3:]],
            tmp_path,
            "pt",
            batch_size=3,
            show_progress=False,
        )
    written = existing_sample_indices(tmp_path, "pt")
    assert written == {100, 101, 102, 105}  # batch 1, then the first result of batch 2
    for index in written:
        assert load_sample(sample_path(tmp_path, index, "pt"))["input_ids"].numel() > 0
    leftovers = [p for p in Path(tmp_path).rglob("*") if p.is_file() and p.suffix != ".pt"]
    assert leftovers == []
