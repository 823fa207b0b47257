"""The transfer file's one layout, as the worker writes it and the driver reads it."""

from __future__ import annotations

import pytest
import torch

from speculators_vllm016.data_generation.transfer import (
    TakenRequest,
    TransferDir,
    TransferLayout,
    map_request,
)
from speculators_vllm016.data_generation.vllm_hidden_states_generator import check_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_len", [1, 3, 17])
def test_worker_writes_and_driver_reads_the_same_bytes(tmp_path, dtype, seq_len):
    layout = TransferLayout.of(3, 5, dtype)  # odd sizes: the counts need alignment padding
    transfer = TransferDir(tmp_path)
    try:
        transfer.allocate("r", layout.file_bytes(seq_len))
        assert layout.seq_len_of(transfer.file_for("r").stat().st_size) == seq_len
        mapped = map_request(transfer.file_for("r"), layout)  # the worker's side
        rows = torch.randn(3, seq_len, 5).to(dtype)
        mapped.rows.copy_(rows)
        mapped.counts.copy_(torch.tensor([seq_len, seq_len - 1, 7]))
        taken = transfer.take("r", layout, seq_len)  # the driver's side
        assert not transfer.file_for("r").exists()
        assert taken.rows_written == [seq_len, seq_len - 1, 7]
        assert len(taken.hidden_states) == 3
        for slot in range(3):
            assert taken.hidden_states[slot].dtype == dtype
            assert torch.equal(taken.hidden_states[slot], rows[slot])
    finally:
        transfer.cleanup()


def test_a_file_of_another_layout_is_refused():
    layout = TransferLayout.of(2, 4, "float32")
    assert layout.file_bytes(10) == 2 * 10 * 4 * 4 + 2 * 8
    with pytest.raises(RuntimeError, match="does not fit the layout"):
        layout.seq_len_of(layout.file_bytes(10) + 4)


def test_the_space_check_and_the_files_agree():
    layout = TransferLayout.of(4, 768, "bfloat16")
    assert layout.token_bytes == 4 * 768 * 2
    assert layout.file_bytes(100) >= 100 * layout.token_bytes


def _taken(rows_written: list[int]) -> TakenRequest:
    return TakenRequest(hidden_states=[], rows_written=rows_written)


def test_row_counts_that_match_pass():
    check_rows("c0-1", 5, [1, 3], _taken([5, 5]))


@pytest.mark.parametrize("counts", [[5, 4], [0, 5], [5, 10], [0, 10]])  # [0, 10]: right total
def test_a_row_count_mismatch_names_the_request_and_the_layer(counts):
    wrong = [layer for layer, count in zip([1, 3], counts) if count != 5]
    with pytest.raises(
        RuntimeError,
        match=rf"request c0-1: captured {sum(counts)} rows, expected 10 .*wrong for layers {wrong}".replace(
            "[", r"\["
        ).replace("]", r"\]"),
    ):
        check_rows("c0-1", 5, [1, 3], _taken(counts))
