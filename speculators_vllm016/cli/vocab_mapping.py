"""`speculators vocab-mapping`: the draft vocabulary (d2t.npy, t2d.npy) from datagen's token counts.

The flags of 0.3.0's scripts/build_vocab_mapping.py: the target vocabulary size is given directly
or read from the target model's config, and both maps are written into the --output-path folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer

__all__ = ["D2T_FILE", "T2D_FILE", "target_vocab_size_of", "vocab_mapping", "write_vocab_mappings",
           "write_vocab_mappings_from_counts"]

D2T_FILE = "d2t.npy"
T2D_FILE = "t2d.npy"


def target_vocab_size_of(target_model_path: str) -> int:
    """`vocab_size` of the target's config (top level or nested, e.g. a multimodal text_config)."""
    from speculators_vllm016.convert.eagle.utils import find_vocab_size, load_verifier_config_dict

    size = find_vocab_size(load_verifier_config_dict(target_model_path))
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"the config of {target_model_path} has no vocab_size; pass --target-vocab-size")
    return size


def write_vocab_mappings(
    token_freq_path: str | Path, draft_vocab_size: int, target_vocab_size: int, output_path: str | Path
) -> tuple[Path, Path]:
    """Build the maps from a `token_freq.pt` and write `d2t.npy`, `t2d.npy` (each whole or not at all)."""
    from speculators_vllm016.data_generation.token_counts import read_token_counts

    token_freq_path = Path(token_freq_path)
    if not token_freq_path.is_file():
        raise FileNotFoundError(
            f"no token frequency file at {token_freq_path}; datagen writes it (--token-freq-path)"
        )
    counts = read_token_counts(token_freq_path)
    return write_vocab_mappings_from_counts(counts, draft_vocab_size, target_vocab_size, output_path)


def write_vocab_mappings_from_counts(
    counts: dict[int, int], draft_vocab_size: int, target_vocab_size: int, output_path: str | Path
) -> tuple[Path, Path]:
    """`d2t.npy` and `t2d.npy` in `output_path` from `{token_id: count}` (e.g. datagen's summed shards)."""
    import numpy as np

    from speculators_vllm016.data_generation.sample_io import _atomic_write
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=counts, draft_vocab_size=draft_vocab_size, target_vocab_size=target_vocab_size
    )
    folder = Path(output_path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output-path {folder} is a file; give a folder for d2t.npy and t2d.npy")
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / D2T_FILE, folder / T2D_FILE
    # Both maps are written whole under temporary names first, then renamed: an old pair is
    # replaced only once the whole new pair is on disk (between the two renames `train`'s check
    # that the maps agree catches a mixed pair).
    staged = [path.with_name(f".new-{path.name}") for path in paths]
    for path, tensor in zip(staged, (d2t, t2d)):
        array = tensor.cpu().numpy()
        _atomic_write(path, lambda handle, array=array: np.save(handle, array), fsync=False)
    for source, target in zip(staged, paths):
        os.replace(source, target)
    return paths


def vocab_mapping(
    token_freq_path: str = typer.Option(
        ..., "--token-freq-path", help="token_freq.pt written by datagen ({token_id: count})."
    ),
    draft_vocab_size: int = typer.Option(
        ..., "--draft-vocab-size", min=1, help="Tokens the draft predicts (e.g. 32000)."
    ),
    target_vocab_size: int | None = typer.Option(
        None, "--target-vocab-size", min=1, help="Target vocabulary size (or --target-model-path)."
    ),
    target_model_path: str | None = typer.Option(
        None, "--target-model-path", help="Target model whose config gives the vocabulary size."
    ),
    output_path: str = typer.Option(
        ..., "--output-path", help="Folder to write d2t.npy and t2d.npy into (created if missing)."
    ),
) -> None:
    """Build the draft vocabulary maps (d2t.npy, t2d.npy) from token frequencies."""
    if (target_vocab_size is None) == (target_model_path is None):
        _fail("pass exactly one of --target-vocab-size and --target-model-path")
    try:
        if target_vocab_size is not None:
            size = target_vocab_size
        else:
            assert target_model_path is not None
            size = target_vocab_size_of(target_model_path)
        d2t_path, t2d_path = write_vocab_mappings(token_freq_path, draft_vocab_size, size, output_path)
    except (ValueError, FileNotFoundError) as error:
        _fail(str(error))
    typer.echo(f"d2t: {d2t_path} ({draft_vocab_size},)  t2d: {t2d_path} ({size},)")


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
