"""`speculators vocab-mapping`: 0.3.0's flags, d2t.npy and t2d.npy in the output folder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

COUNTS = {token: (token * 37) % 101 + 1 for token in range(0, 512, 2)}


@pytest.fixture
def token_freq(tmp_path):
    path = tmp_path / "token_freq.pt"
    torch.save(COUNTS, path)
    return path


def invoke(*args):
    return CliRunner().invoke(app, ["vocab-mapping", *map(str, args)])


@pytest.mark.parametrize("size_flag", ["--target-vocab-size", "--target-model-path"])
def test_writes_the_maps_of_the_library_function(tmp_path, token_freq, tiny_llama, size_flag):
    size_value = 512 if size_flag == "--target-vocab-size" else tiny_llama
    out = tmp_path / "vocab"
    result = invoke(
        "--token-freq-path",
        token_freq,
        "--draft-vocab-size",
        64,
        size_flag,
        size_value,
        "--output-path",
        out,
    )
    assert result.exit_code == 0, result.output
    d2t, t2d = build_vocab_mappings_from_distribution(COUNTS, 64, 512)
    assert sorted(p.name for p in out.iterdir()) == ["d2t.npy", "t2d.npy"]
    assert np.array_equal(np.load(out / "d2t.npy"), d2t.numpy())
    assert np.array_equal(np.load(out / "t2d.npy"), t2d.numpy())
    assert np.load(out / "t2d.npy").dtype == np.bool_ and np.load(out / "d2t.npy").shape == (64,)


def test_exactly_one_target_size_source(tmp_path, token_freq, tiny_llama):
    base = [
        "--token-freq-path",
        token_freq,
        "--draft-vocab-size",
        64,
        "--output-path",
        tmp_path / "o",
    ]
    for extra in ([], ["--target-vocab-size", 512, "--target-model-path", tiny_llama]):
        result = invoke(*base, *extra)
        assert result.exit_code == 2
        assert "exactly one of --target-vocab-size and --target-model-path" in result.output
    assert not (tmp_path / "o").exists()


def test_bad_inputs_get_one_line_errors(tmp_path, token_freq):
    missing = invoke(
        "--token-freq-path",
        tmp_path / "nope.pt",
        "--draft-vocab-size",
        8,
        "--target-vocab-size",
        512,
        "--output-path",
        tmp_path / "o",
    )
    assert missing.exit_code == 2 and "no token frequency file" in missing.output
    too_big = invoke(
        "--token-freq-path",
        token_freq,
        "--draft-vocab-size",
        600,
        "--target-vocab-size",
        512,
        "--output-path",
        tmp_path / "o",
    )
    assert too_big.exit_code == 2 and "is larger than the target's vocabulary" in too_big.output
    assert not (tmp_path / "o" / "d2t.npy").exists()


def test_unreadable_inputs_and_outputs_get_one_line_errors(tmp_path):
    corrupt = tmp_path / "token_freq.pt"
    corrupt.write_bytes(b"not a torch file")
    result = invoke(
        "--token-freq-path",
        corrupt,
        "--draft-vocab-size",
        8,
        "--target-vocab-size",
        512,
        "--output-path",
        tmp_path / "o",
    )
    assert result.exit_code == 2 and "is not a readable token frequency file" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    torch.save(COUNTS, corrupt)
    a_file = tmp_path / "maps"
    a_file.write_text("")
    result = invoke(
        "--token-freq-path",
        corrupt,
        "--draft-vocab-size",
        8,
        "--target-vocab-size",
        512,
        "--output-path",
        a_file,
    )
    assert result.exit_code == 2 and "is a file; give a folder" in result.output


def test_a_rebuild_replaces_the_pair_and_leaves_no_staged_files(tmp_path, token_freq):
    out = tmp_path / "vocab"
    for size in (64, 32):
        result = invoke(
            "--token-freq-path",
            token_freq,
            "--draft-vocab-size",
            size,
            "--target-vocab-size",
            512,
            "--output-path",
            out,
        )
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["d2t.npy", "t2d.npy"]
    d2t, t2d = build_vocab_mappings_from_distribution(COUNTS, 32, 512)
    assert np.array_equal(np.load(out / "d2t.npy"), d2t.numpy())
    assert np.array_equal(np.load(out / "t2d.npy"), t2d.numpy())


def test_a_datagen_folder_is_read_as_its_summed_shards(tmp_path):
    """`--token-freq-path` takes datagen's --output-dir, as `load_token_freq` reads it (#29 item 11)."""
    data = tmp_path / "data"
    (data / "token_freq").mkdir(parents=True)
    tokens = sorted(COUNTS)
    halves = [{t: COUNTS[t] for t in tokens[:100]}, {t: COUNTS[t] for t in tokens[100:]}]
    halves[1][tokens[0]] = 5  # a token counted by both shards: the counts add up
    for i, half in enumerate(halves):
        torch.save(half, data / "token_freq" / f"shard-{i}-of-2.pth")
    summed = {**COUNTS, tokens[0]: COUNTS[tokens[0]] + 5}
    d2t, t2d = build_vocab_mappings_from_distribution(summed, 64, 512)
    for given in (data, data / "token_freq"):
        out = tmp_path / f"vocab_{given.name}"
        result = invoke(
            "--token-freq-path",
            given,
            "--draft-vocab-size",
            64,
            "--target-vocab-size",
            512,
            "--output-path",
            out,
        )
        assert result.exit_code == 0, result.output
        assert np.array_equal(np.load(out / "d2t.npy"), d2t.numpy())
        assert np.array_equal(np.load(out / "t2d.npy"), t2d.numpy())
    (data / "token_freq" / "shard-1-of-2.pth").unlink()
    result = invoke(
        "--token-freq-path",
        data,
        "--draft-vocab-size",
        64,
        "--target-vocab-size",
        512,
        "--output-path",
        tmp_path / "o",
    )
    assert result.exit_code == 2 and "incomplete or mixed set of shards" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke(
        "--token-freq-path",
        empty,
        "--draft-vocab-size",
        64,
        "--target-vocab-size",
        512,
        "--output-path",
        tmp_path / "o",
    )
    assert result.exit_code == 2 and "no token counts in" in result.output
    assert not (tmp_path / "o").exists()
