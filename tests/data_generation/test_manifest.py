"""The lengths index: torn lines from a crash are skipped, later records win, shards are merged."""

from __future__ import annotations

import subprocess
import sys

from speculators_vllm016.data_generation.manifest import (
    ManifestWriter,
    SampleRecord,
    manifest_path,
    read_manifest,
)


def test_records_of_every_shard_later_ones_winning_torn_lines_skipped(tmp_path):
    with ManifestWriter(manifest_path(tmp_path, 0, 2)) as writer:
        writer.append(SampleRecord("data_0.pt", 0, 10, 100, "aa"))
        writer.append(SampleRecord("data_2.pt", 2, 12, 120, None))
    with ManifestWriter(manifest_path(tmp_path, 1, 2)) as writer:
        writer.append(SampleRecord("data_1.pt", 1, 11, 110, "bb"))
    shard0 = manifest_path(tmp_path, 0, 2)
    with open(shard0, "a") as handle:
        handle.write('{"file": "data_4.pt", "index": 4, "len')  # a crash mid-line
    records = read_manifest(tmp_path)
    assert sorted(records) == ["data_0.pt", "data_1.pt", "data_2.pt"]
    assert records["data_2.pt"] == SampleRecord("data_2.pt", 2, 12, 120, None)
    # Resumed: the torn line is ended, and a recomputed file's new record wins.
    with ManifestWriter(shard0) as writer:
        writer.append(SampleRecord("data_0.pt", 0, 10, 101, "cc"))
    records = read_manifest(tmp_path)
    assert records["data_0.pt"].bytes == 101 and "data_4.pt" not in records
    assert read_manifest(tmp_path / "nothing-here") == {}


def test_reading_the_manifest_imports_neither_torch_nor_vllm():
    code = (
        "import sys; import speculators_vllm016.data_generation.manifest as m; "
        "m.read_manifest('.'); print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
