"""Sample files: 0.3.0 layout, both formats, atomic writes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from speculators_vllm016.data_generation.sample_io import (
    existing_sample_indices,
    load_sample,
    remove_partial_files,
    sample_bytes,
    sample_path,
    write_sample,
)


def make_sample(seq: int = 7, hidden: int = 16, layers: int = 4) -> dict:
    generator = torch.Generator().manual_seed(0)
    # Views of one storage, as the generator returns them.
    stacked = torch.randn(layers, seq, hidden, generator=generator).to(torch.bfloat16)
    return {
        "input_ids": torch.arange(seq),
        "hidden_states": list(stacked.unbind(0)),
        "loss_mask": torch.tensor([0, 0, 1, 1, 1, 0, 1][:seq]),
    }


@pytest.mark.parametrize("output_format", ["pt", "safetensors"])
def test_round_trip(tmp_path, output_format):
    sample = make_sample()
    path = sample_path(tmp_path, 3, output_format)
    write_sample(path, sample, output_format)
    loaded = load_sample(path)
    assert torch.equal(loaded["input_ids"], sample["input_ids"])
    assert loaded["input_ids"].dtype == torch.long and loaded["loss_mask"].dtype == torch.long
    assert torch.equal(loaded["loss_mask"], sample["loss_mask"])
    assert len(loaded["hidden_states"]) == 4
    for got, want in zip(loaded["hidden_states"], sample["hidden_states"]):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert existing_sample_indices(tmp_path, output_format) == {3}


def test_pt_file_is_the_0_3_0_layout_readable_by_its_trainer(tmp_path):
    path = sample_path(tmp_path, 0, "pt")
    write_sample(path, make_sample(), "pt")
    data = torch.load(path, weights_only=True, mmap=True)
    assert set(data) == {"input_ids", "hidden_states", "loss_mask"}
    assert isinstance(data["hidden_states"], list)
    # Each layer is its own tensor (not a view of a shared stack), as 0.3.0 wrote them.
    storages = {layer.untyped_storage().data_ptr() for layer in data["hidden_states"]}
    assert len(storages) == 4
    # The trainer's "v1" standardization: aux layers concatenated, the last one as verifier state.
    fused = torch.cat(data["hidden_states"][:-1], dim=-1)
    assert fused.shape == (7, 48)


def test_a_failed_write_leaves_nothing_under_the_final_name(tmp_path):
    class Exploding:
        def contiguous(self):
            raise RuntimeError("disk full")

    sample = make_sample()
    sample["hidden_states"][1] = Exploding()
    path = sample_path(tmp_path, 0, "pt")
    with pytest.raises(RuntimeError):
        write_sample(path, sample, "pt")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


# Run in a child process: the serializer writes part of the file, looks at the directory, then the
# process dies on the spot (os._exit: no cleanup, no exception handler, like SIGKILL).
_KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from speculators_vllm016.data_generation import sample_io
    from speculators_vllm016.utils import atomic_files  # opens the temporary file sample_io writes

    directory, output_format = Path(sys.argv[1]), sys.argv[2]
    final = sample_io.sample_path(directory, 0, output_format)

    def die_half_way(data: bytes, target) -> None:
        handle = open(target, "wb") if isinstance(target, (str, os.PathLike)) else target
        handle.write(data[: len(data) // 2])
        handle.flush()
        names = sorted(entry.name for entry in os.scandir(directory))
        print("WRITING", final.name in names, len([n for n in names if n != final.name]), flush=True)
        os._exit(9)

    if output_format == "pt":
        real_save = torch.save

        def save(obj, target, *args, **kwargs):
            import io
            buffer = io.BytesIO()
            real_save(obj, buffer)
            die_half_way(buffer.getvalue(), target)

        torch.save = save
    else:
        real_open = open

        class HalfWriter:
            def __init__(self, handle):
                self.handle = handle
            def write(self, data):
                die_half_way(bytes(data), self.handle)
            def __getattr__(self, name):
                return getattr(self.handle, name)
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                self.handle.close()

        atomic_files.open = lambda path, mode="r", *a, **k: HalfWriter(real_open(path, mode, *a, **k))

    sample = {
        "input_ids": torch.arange(64),
        "hidden_states": [torch.randn(64, 32) for _ in range(3)],
        "loss_mask": torch.ones(64, dtype=torch.long),
    }
    sample_io.write_sample(final, sample, output_format)
    print("NOT KILLED")
    """
)


@pytest.mark.parametrize("output_format", ["pt", "safetensors"])
def test_a_process_killed_mid_write_leaves_nothing_under_the_final_name(tmp_path, output_format):
    """The bytes go to another file first: a kill half-way leaves no `data_0.*` at all."""
    completed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_WRITE, str(tmp_path), output_format],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert completed.returncode == 9, completed.stderr[-2000:]
    # While half the bytes were on disk: nothing under the final name, one other (temporary) file.
    assert "WRITING False 1" in completed.stdout, completed.stdout
    assert sample_path(tmp_path, 0, output_format).exists() is False
    assert existing_sample_indices(tmp_path, output_format) == set()
    # The next run removes the leftover.
    assert remove_partial_files(tmp_path) == 1
    assert list(tmp_path.iterdir()) == []


def test_partial_files_are_removed(tmp_path):
    (tmp_path / ".tmp-1234abcd-data_5.pt").write_bytes(b"half")
    write_sample(sample_path(tmp_path, 4, "pt"), make_sample(), "pt")
    assert remove_partial_files(tmp_path) == 1
    assert existing_sample_indices(tmp_path, "pt") == {4}


@pytest.mark.parametrize("output_format", ["pt", "safetensors"])
def test_sample_bytes_is_what_a_file_takes_but_its_header(tmp_path, output_format):
    """docs/datagen.md's disk figures (Kimi-K2.5 at 2k, 20k and 128k tokens) come from
    `sample_bytes`: it must be the writer's real size per token (ids, mask, states, fp8 scales)."""
    tokens, hidden, layers = 1000, 96, 4
    sample = make_sample(seq=tokens, hidden=hidden, layers=layers)
    sample["loss_mask"] = torch.ones(tokens, dtype=torch.long)
    for storage, state_bytes, dtype in (("bf16", 2, torch.bfloat16), ("bf16", 4, torch.float32)):
        sample["hidden_states"] = [layer.to(dtype) for layer in sample["hidden_states"]]
        size = write_sample(tmp_path / f"a.{output_format}", sample, output_format)
        header = size - sample_bytes(tokens, hidden, layers, storage, state_bytes)
        assert 0 <= header < 4096, (storage, state_bytes)
    size = write_sample(tmp_path / f"b.{output_format}", sample, output_format, storage_dtype="fp8")
    assert 0 <= size - sample_bytes(tokens, hidden, layers, "fp8") < 4096
