"""The draft vocabulary maps on disk: `d2t.npy` and `t2d.npy`, written as a pair, read and checked.

`d2t[i]` is an offset: draft token `i` is target token `i + d2t[i]`; `t2d[j]` is True for the
target tokens the draft predicts. The two files are one map: `write_vocab_mappings_from_counts`
replaces an old pair only once the whole new pair is on disk, and `load_vocab_maps` refuses two
files of different builds. Building the maps from counts is `train.vocab_mapping`'s (0.3.0's path).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.utils.atomic_files import atomic_write, temporary_path
from speculators_vllm016.utils.errors import InvalidInputError, first_line, type_and_first_line

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("speculators")


__all__ = [
    "D2T_FILE",
    "T2D_FILE",
    "VocabMaps",
    "load_vocab_maps",
    "read_folder_token_counts",
    "resolve_vocab_paths",
    "save_vocab_maps",
    "target_vocab_size_of",
    "token_counts_for_training",
    "write_vocab_mappings",
    "write_vocab_mappings_from_counts",
]

D2T_FILE = "d2t.npy"
T2D_FILE = "t2d.npy"


@dataclass
class VocabMaps:
    """The maps a draft trains with, checked against the verifier's vocabulary."""

    d2t: torch.Tensor
    """int64 [draft_vocab]: draft token i is target token i + d2t[i]."""
    t2d: torch.Tensor
    """bool [target_vocab]: the target tokens the draft predicts."""
    built_from: str | None
    """The token counts they were built from (then training saves them), or None when read."""


def target_vocab_size_of(target_model_path: str) -> int:
    """`vocab_size` of the target's config (top level or nested, e.g. a multimodal text_config)."""
    from speculators_vllm016.utils.verifier_config import find_vocab_size, load_verifier_config_dict

    size = find_vocab_size(load_verifier_config_dict(target_model_path))
    if not isinstance(size, int) or size < 1:
        raise InvalidInputError(
            f"the config of {target_model_path} has no vocab_size; pass --target-vocab-size"
        )
    return size


def write_vocab_mappings(
    token_freq_path: str | Path,
    draft_vocab_size: int,
    target_vocab_size: int,
    output_path: str | Path,
) -> tuple[Path, Path]:
    """Build the maps from a `token_freq.pt`, or from a datagen folder (its `token_freq/` shards,
    summed), and write `d2t.npy`, `t2d.npy` (each whole or not at all)."""
    from speculators_vllm016.data_generation.token_counts import read_token_counts

    token_freq_path = Path(token_freq_path)
    if token_freq_path.is_dir():
        counts = read_folder_token_counts(token_freq_path)
    elif token_freq_path.is_file():
        counts = read_token_counts(token_freq_path)
    else:
        raise FileNotFoundError(
            f"no token frequency file at {token_freq_path}; give datagen's --output-dir (it counts "
            "tokens in token_freq/) or the token_freq.pt of datagen's --token-freq-path"
        )
    return write_vocab_mappings_from_counts(
        counts, draft_vocab_size, target_vocab_size, output_path
    )


def read_folder_token_counts(folder: Path) -> dict[int, int]:
    """The counts of a datagen folder (its `token_freq/` shards summed; that folder itself is
    accepted too), else of a `token_freq.pt` inside it."""
    from speculators_vllm016.data_generation.token_counts import (
        TOKEN_FREQ_DIR,
        load_token_freq,
        read_token_counts,
    )

    if (folder / TOKEN_FREQ_DIR).is_dir():
        return load_token_freq(folder)
    if folder.name == TOKEN_FREQ_DIR and any(folder.glob("shard-*-of-*.pth")):
        return load_token_freq(folder.parent)
    if (folder / "token_freq.pt").is_file():
        return read_token_counts(folder / "token_freq.pt")
    raise FileNotFoundError(
        f"no token counts in {folder}: neither datagen's {TOKEN_FREQ_DIR}/ shards nor a token_freq.pt"
    )


def write_vocab_mappings_from_counts(
    counts: dict[int, int], draft_vocab_size: int, target_vocab_size: int, output_path: str | Path
) -> tuple[Path, Path]:
    """`d2t.npy` and `t2d.npy` in `output_path` from `{token_id: count}` (e.g. datagen's summed shards)."""
    import numpy as np

    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=counts,
        draft_vocab_size=draft_vocab_size,
        target_vocab_size=target_vocab_size,
    )
    folder = Path(output_path)
    if folder.exists() and not folder.is_dir():
        raise InvalidInputError(
            f"--output-path {folder} is a file; give a folder for d2t.npy and t2d.npy"
        )
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / D2T_FILE, folder / T2D_FILE
    # Both maps are first written whole under temporary names (the package's scheme), then
    # renamed: an old pair is replaced only once the whole new pair is on disk (between the two
    # renames `load_vocab_maps`' check that the maps agree catches a mixed pair).
    staged = [temporary_path(path) for path in paths]
    try:
        for temporary, tensor in zip(staged, (d2t, t2d)):
            array = tensor.cpu().numpy()
            atomic_write(temporary, lambda handle, array=array: np.save(handle, array))
        for temporary, path in zip(staged, paths):
            os.replace(temporary, path)
    finally:
        for temporary in staged:
            temporary.unlink(missing_ok=True)
    return paths


def token_counts_for_training(
    token_freq_path: str | None, data_path: Path
) -> tuple[dict[int, int], str]:
    """Token counts from `token_freq_path` (a `token_freq.pt`, or a datagen folder whose
    `token_freq/` shards are summed), else datagen's per-shard counts beside the data; with
    where they came from."""
    from speculators_vllm016.data_generation.token_counts import (
        TOKEN_FREQ_DIR,
        load_token_freq,
        read_token_counts,
    )

    path = Path(token_freq_path) if token_freq_path else data_path / "token_freq.pt"
    if token_freq_path and path.is_dir():  # a datagen folder, as vocab-mapping takes it
        try:
            return read_folder_token_counts(path), str(path)
        except (OSError, ValueError, RuntimeError) as error:
            raise TrainSetupError(f"--token-freq-path: {first_line(error)}") from None
    if token_freq_path is None and (data_path / TOKEN_FREQ_DIR).is_dir():
        try:
            return load_token_freq(data_path), str(data_path / TOKEN_FREQ_DIR)
        except (OSError, ValueError, RuntimeError) as error:
            raise TrainSetupError(f"cannot read token counts: {first_line(error)}") from None
    if path.is_file():
        try:
            return read_token_counts(path), str(path)
        except ValueError as error:
            raise TrainSetupError(
                f"cannot read token counts from {path} ({type_and_first_line(error.__cause__ or error)}); "
                "it must be a {token_id: count} mapping saved by datagen or vocab-mapping"
            ) from None
    raise TrainSetupError(
        "--draft-vocab-size needs token counts: give --token-freq-path, or point --data-path at "
        f"a datagen folder (it writes {TOKEN_FREQ_DIR}/ beside the samples); none in {data_path}"
    )


def resolve_vocab_paths(
    d2t_path: str | None, t2d_path: str | None, save_path: Path, draft_vocab_size: int | None
) -> tuple[Path, Path]:
    """Where a run reads its maps. Given paths win (one alone: its pair beside it, by name).
    Else the run's own pair beside its checkpoints (what an earlier start of it built), which
    is also where `--draft-vocab-size` builds them. Only without `--draft-vocab-size` is 0.3.0's
    default place, the working directory, still read, and said so."""
    if d2t_path is not None or t2d_path is not None:
        d2t = Path(d2t_path) if d2t_path is not None else Path(t2d_path).parent / D2T_FILE  # type: ignore[arg-type]
        t2d = Path(t2d_path) if t2d_path is not None else d2t.parent / T2D_FILE
        return d2t, t2d
    beside = save_path / D2T_FILE, save_path / T2D_FILE
    if draft_vocab_size or any(path.is_file() for path in beside):
        return beside
    here = Path(D2T_FILE), Path(T2D_FILE)
    if all(path.is_file() for path in here):
        logger.warning(
            "reading %s and %s from the working directory (0.3.0's default place); name them "
            "with --d2t-path/--t2d-path",
            *here,
        )
        return here
    return beside


def load_vocab_maps(
    d2t_path: str | Path,
    t2d_path: str | Path,
    target_vocab: int,
    *,
    draft_vocab_size: int | None = None,
    token_freq_path: str | None = None,
    data_path: Path | None = None,
    counts: dict[int, int] | None = None,
) -> VocabMaps:
    """The pair at `d2t_path`/`t2d_path`; when either is missing and `draft_vocab_size` is given,
    built from token counts (`counts`, e.g. online training's samples, unless `token_freq_path`;
    else `token_counts_for_training`). Refuses maps that do not fit `target_vocab` or each other."""
    import numpy as np
    import torch

    d2t_path, t2d_path = Path(d2t_path), Path(t2d_path)
    if d2t_path.is_file() and t2d_path.is_file():
        try:
            d2t = torch.from_numpy(np.load(d2t_path)).long()
            t2d = torch.from_numpy(np.load(t2d_path)).bool()
        except Exception as error:  # noqa: BLE001
            raise TrainSetupError(f"cannot read {d2t_path} / {t2d_path}: {error}") from None
        built_from = None
        if draft_vocab_size and d2t.ndim == 1 and d2t.shape[0] != draft_vocab_size:
            raise TrainSetupError(
                f"{d2t_path} maps {d2t.shape[0]} draft tokens but --draft-vocab-size is "
                f"{draft_vocab_size}: leave the flag out to train with these maps, or remove them "
                "(or give other --d2t-path/--t2d-path) to build new ones"
            )
    elif draft_vocab_size:
        from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

        if counts is not None and not token_freq_path:  # online: the preprocessed samples
            built_from = "the --train-data-path samples"
        else:
            counts, built_from = token_counts_for_training(token_freq_path, Path(data_path or "."))
        try:
            d2t, t2d = build_vocab_mappings_from_distribution(
                counts, draft_vocab_size, target_vocab
            )
        except ValueError as error:
            raise TrainSetupError(str(error)) from None  # names --draft-vocab-size itself
    else:
        raise TrainSetupError(
            f"no vocabulary maps: {d2t_path} / {t2d_path} do not exist; give --d2t-path/--t2d-path "
            "(speculators vocab-mapping writes them) or --draft-vocab-size with token counts"
        )
    if t2d.ndim != 1 or t2d.shape[0] != target_vocab:
        raise TrainSetupError(
            f"t2d has shape {tuple(t2d.shape)} but the verifier's vocabulary has {target_vocab} "
            "tokens: rebuild the maps with --target-vocab-size of this verifier"
        )
    if d2t.ndim != 1 or int(t2d.sum()) != d2t.shape[0]:
        raise TrainSetupError(
            f"d2t has {d2t.shape[0]} entries but t2d marks {int(t2d.sum())} tokens: the two files "
            "belong to different maps; rebuild both"
        )
    # d2t holds offsets: draft token i is target token i + d2t[i]. Those targets must be exactly
    # the tokens t2d marks (same-sized maps of two builds pass the count check above).
    targets = torch.arange(d2t.shape[0]) + d2t
    if bool((targets < 0).any() or (targets >= target_vocab).any()) or not bool(
        torch.equal(torch.sort(targets).values, torch.nonzero(t2d).flatten())
    ):
        raise TrainSetupError(
            "d2t's target tokens are not the tokens t2d marks: the two files belong to different "
            "maps (a rebuild replaced one of them?); rebuild both with speculators vocab-mapping"
        )
    return VocabMaps(d2t=d2t, t2d=t2d, built_from=built_from)


def save_vocab_maps(maps: VocabMaps, folder: Path) -> None:
    """Maps built for this run, saved beside its checkpoints so the run can be served and resumed."""
    import numpy as np

    for name, tensor in ((D2T_FILE, maps.d2t), (T2D_FILE, maps.t2d)):
        array = tensor.numpy()
        atomic_write(folder / name, lambda handle, array=array: np.save(handle, array))
