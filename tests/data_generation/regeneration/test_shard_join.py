"""How the shards of `datagen --regenerate --num-shards N` meet (pure logic; the engine run is in
test_regenerate_kimi.py): one row->shard rule, waiting for the others, the joined file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from speculators_vllm016.data_generation.offline import shard_positions
from speculators_vllm016.data_generation.regeneration.row_log import output_file_names
from speculators_vllm016.data_generation.regeneration.shard_join import (
    join_shard_files,
    missing_shards,
    wait_for_shards,
)
from speculators_vllm016.data_generation.regeneration.turns import SourceRow, shard_rows


@pytest.mark.parametrize("num_rows", [0, 1, 7, 12])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_regeneration_and_datagen_give_shard_i_the_same_rows(num_rows, num_shards):
    """`regenerate --num-shards` (over the data's rows) and datagen (over its samples) use one
    rule: shard I takes I, I+N, I+2N, ..."""
    rows = [SourceRow(row, raw=None, messages=[]) for row in range(num_rows)]
    for index in range(num_shards):
        regenerated = [row.row for row in shard_rows(rows, num_shards, index)]
        assert regenerated == shard_positions(num_rows, num_shards, index)


def _write_shard(folder: Path, index: int, num_shards: int, rows: list[int]) -> None:
    name = output_file_names(index, num_shards)[0]
    lines = [json.dumps({"row": row, "messages": [{"role": "user", "content": f"é{row}"}]},
                        ensure_ascii=False) for row in rows]  # fmt: skip
    (folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_a_shard_waits_for_the_others_then_joins_every_row_in_data_order(tmp_path, caplog):
    _write_shard(tmp_path, 1, 3, [1, 4])
    slept = []

    def sleep(seconds: float) -> None:  # the other shards finish while this one waits
        slept.append(seconds)
        _write_shard(tmp_path, len(slept) * 2 - 2, 3, [0, 3, 6] if len(slept) == 1 else [2, 5])

    with caplog.at_level(logging.INFO):
        wait_for_shards(tmp_path, 3, poll_seconds=7.0, sleep=sleep)
    assert slept == [7.0, 7.0] and missing_shards(tmp_path, 3) == []
    assert "waiting for shards [0, 2] of 3" in caplog.text
    joined = join_shard_files(tmp_path, 3)
    assert joined.name == output_file_names(0, 1)[0]
    lines = joined.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["row"] for line in lines] == list(range(7))
    assert "é4" in lines[4]  # each line as its shard wrote it
    before = joined.stat().st_mtime_ns
    join_shard_files(tmp_path, 3)  # a later shard joining finds the same bytes
    assert joined.stat().st_mtime_ns == before
