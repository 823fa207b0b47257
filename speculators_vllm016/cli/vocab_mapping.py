"""`speculators vocab-mapping`: the draft vocabulary (d2t.npy, t2d.npy) from datagen's token counts.

The flags of 0.3.0's scripts/build_vocab_mapping.py (--token-freq-path also takes a datagen folder): the target vocabulary size is given directly
or read from the target model's config, and both maps are written into the --output-path folder
(by `train.vocab_maps`, which the demo and gen-and-train call too).
"""

from __future__ import annotations

from typing import NoReturn

import typer

from speculators_vllm016.train.vocab_maps import (
    target_vocab_size_of,
    write_vocab_mappings,
)
from speculators_vllm016.utils.command_errors import (
    EXIT_ERROR,
    EXPECTED_ERRORS,
    describe_error,
    error_line,
)
from speculators_vllm016.utils.output_paths import check_output_folder

__all__ = ["vocab_mapping"]


def vocab_mapping(
    token_freq_path: str = typer.Option(
        ...,
        "--token-freq-path",
        help="Datagen's --output-dir (its token_freq/ shard counts are summed) or a token_freq.pt "
        "({token_id: count}, datagen's --token-freq-path).",
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
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
) -> None:
    """Build the draft vocabulary maps (d2t.npy, t2d.npy) from token frequencies."""
    if (target_vocab_size is None) == (target_model_path is None):
        _fail("pass exactly one of --target-vocab-size and --target-model-path")
    try:
        check_output_folder(output_path, "--output-path")
        if target_vocab_size is not None:
            size = target_vocab_size
        else:
            assert target_model_path is not None
            size = target_vocab_size_of(target_model_path)
        d2t_path, t2d_path = write_vocab_mappings(
            token_freq_path, draft_vocab_size, size, output_path
        )
    except EXPECTED_ERRORS as error:
        if debug:
            raise
        _fail(describe_error(error))
    typer.echo(f"d2t: {d2t_path} ({draft_vocab_size},)  t2d: {t2d_path} ({size},)")


def _fail(message: str) -> NoReturn:
    typer.echo(error_line(message), err=True)
    raise typer.Exit(EXIT_ERROR)
