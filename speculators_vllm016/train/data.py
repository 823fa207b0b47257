"""Sample files -> packed training rows: the data side of the data -> trainer contract.

The contract (what every training step receives, per rank):

    PackedBatch = {
        "input_ids":                   LongTensor  [1, T]          token t+1 of each pair
        "hidden_states":               FloatTensor [1, T, (n-1)*H] fused auxiliary states of token t
        "verifier_last_hidden_states": FloatTensor [1, T, H]       last captured layer, token t+1
        "loss_mask":                   LongTensor  [1, T]          1 where the predicted token is trained
        "position_ids":                LongTensor  [1, T]          restart at 1 in every sample
        "lengths":                     LongTensor  [k]             tokens of each packed sample (sum <= T)
        "skipped_samples":             LongTensor  []              samples of this row dropped as unusable
    }

`skipped_samples` is there only when a sample of the row was dropped (0.3.0's rows have no such
key, and code written for them compares the keys): a row without it skipped nothing.

A row whose samples were all unusable is `{"skipped_samples": n}` alone: the trainer then runs
its one-token empty row, so the step (and on several ranks, every collective) still happens and
the plan stays the same on every rank and on resume.

`T` is `--total-seq-len`. A row holds whole samples (cut only when a sample alone is longer than
`T`), padded with zeros. Each sample is shifted by one token first (`shift_batch`): the states of
token t are paired with token t + 1, and the draft at that position predicts token t + 2, whose
distribution the verifier's state of token t + 1 gives. `loss_mask` therefore says whether token
t + 2 is an assistant token (0.3.0 used token t + 1's flag: its defect D9, kept behind
`legacy_loss_mask_shift=True`).

Sample files are what datagen writes (`data_{idx}.pt` or `data_{idx}.safetensors`; format v1,
or v0 with `standardize_data_v0`). Nothing else in the data folder is read as a sample (0.3.0's
D12). Sample lengths come from datagen's manifest when present, else from each file's header, read
once; never from file sizes (D5).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from typing_extensions import NotRequired

from speculators_vllm016.data_generation.sample_io import SAMPLE_FILE  # the one home of the name
from speculators_vllm016.train import stored_states
from speculators_vllm016.train.noise_transforms import RowNoise, TransformTensors, noise_seed
from speculators_vllm016.utils.errors import InvalidInputError, RunFailedError, type_and_first_line

__all__ = [
    "BatchType",
    "DataSourceError",
    "Eagle3SampleFileDataset",
    "IncompleteDataError",
    "PackedBatch",
    "SampleFileError",
    "check_sample_shapes",
    "create_collate_fn",
    "list_files",
    "new_row_buffer",
    "pack_samples",
    "sample_lengths",
    "shift_batch",
    "slice_and_pad_to_length",
    "prepare_sample",
    "sample_widths",
    "shared_empty",
    "split_files",
    "split_items",
    "standardize_data_v0",
    "standardize_data_v1",
]

logger = logging.getLogger(__name__)

BatchType = dict[str, Any]
T = TypeVar("T")
StandardizeFnSig = Callable[[dict[str, Any]], dict[str, Any]]

MODEL_INPUTS = (
    "input_ids",
    "hidden_states",
    "verifier_last_hidden_states",
    "loss_mask",
    "position_ids",
    "lengths",
)


class PackedBatch(TypedDict):
    """One packed row per rank and step; see the module docstring for shapes and meaning."""

    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    verifier_last_hidden_states: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    skipped_samples: NotRequired[torch.Tensor]


class SampleFileError(InvalidInputError):
    """A sample file that cannot be used: unreadable, of the wrong layout, or not finite."""


class IncompleteDataError(SampleFileError):
    """A datagen folder lacks sample files its run lists (a run stopped half-way, a lost copy)."""


class DataSourceError(RunFailedError):
    """The source of rows failed (e.g. online extraction's engine died); the trainer checkpoints."""


def list_files(path: str | os.PathLike, check_complete: bool = True) -> list[Path]:
    """Every sample file under `path` (recursively), in a stable order: folder, then index.

    A datagen folder that lacks sample files its run record or manifest lists is refused
    (`IncompleteDataError`) unless `check_complete` is off: training on part of a run would look
    like success. Folders without either (0.3.0's layout) are taken as they are.
    """
    from speculators_vllm016.data_generation.completeness import missing_samples

    found: list[tuple[str, int, str, Path]] = []
    for root, directories, files in os.walk(path):
        directories[:] = [name for name in directories if not name.startswith(".")]
        names = [name for name in files if SAMPLE_FILE.match(name)]
        if check_complete:
            missing = missing_samples(root, names)
            if missing is not None:
                raise IncompleteDataError(missing.message())
        for name in names:
            match = SAMPLE_FILE.match(name)
            found.append((root, int(match.group(1)), match.group(2), Path(root) / name))
    found.sort(key=lambda entry: entry[:3])
    return [entry[3] for entry in found]


def split_files(datapath: str, ratio: float = 0.9, seed: int = 0) -> tuple[list[Path], list[Path]]:
    """Shuffle the sample files with `seed` and split them `ratio : 1 - ratio` (train, validation)."""
    return split_items(list_files(datapath), ratio, seed)


def split_items(items: Sequence[T], ratio: float = 0.9, seed: int = 0) -> tuple[list[T], list[T]]:
    """`split_files` over any list in its stable order (online training splits sample indices).

    The shuffle depends only on `seed` and the list's length, so datagen's files in index order and
    the same indices split alike.
    """
    if not 0.0 < ratio <= 1.0:
        raise InvalidInputError(f"the training share must be in (0, 1], got {ratio}")
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    cut = int(len(shuffled) * ratio)
    if shuffled and cut == 0:
        cut = 1  # never an empty training set while there is data
    return shuffled[:cut], shuffled[cut:]


def slice_and_pad_to_length(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Cut or zero-pad the first dimension of `tensor` to `length`."""
    kept = tensor[:length]
    missing = length - kept.shape[0]
    if missing == 0:
        return kept
    padding = [0, 0] * (kept.dim() - 1) + [0, missing]
    return F.pad(kept, padding)


def standardize_data_v0(data: dict[str, Any]) -> dict[str, Any]:
    """v0 files: `hidden_state` is already the fused input, `target` the last layer."""
    return {
        "input_ids": data["input_ids"],
        "hidden_states": data["hidden_state"],
        "verifier_last_hidden_states": data["target"],
        "loss_mask": data["loss_mask"],
    }


def standardize_data_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 files (datagen's): all captured layers but the last are fused, the last is the teacher."""
    layers = list(data["hidden_states"])
    if len(layers) < 2:
        raise SampleFileError(f"a v1 sample needs at least 2 captured layers, found {len(layers)}")
    return {
        "input_ids": data["input_ids"],
        "hidden_states": torch.cat(layers[:-1], dim=-1),
        "verifier_last_hidden_states": layers[-1],
        "loss_mask": data["loss_mask"],
    }


def check_sample_shapes(data: dict[str, Any], widths: tuple[int, int] | None = None) -> None:
    """Refuse a standardized sample whose tensors disagree (`SampleFileError`); shapes only.

    Every tensor needs one row per token, and at least one token: a sample with extra rows of
    states would shift every later sample of its packed row. `widths` (fused, teacher) are the
    widths the other samples have (the same verifier layers captured).
    """
    ids = data["input_ids"]
    if ids.dim() != 1 or ids.shape[0] == 0:
        raise SampleFileError(
            f"input_ids has shape {tuple(ids.shape)}; a sample needs 1 token or more"
        )
    tokens = int(ids.shape[0])
    for key, dims in (("hidden_states", 2), ("verifier_last_hidden_states", 2), ("loss_mask", 1)):
        shape = tuple(data[key].shape)
        if len(shape) != dims or shape[0] != tokens:
            raise SampleFileError(
                f"{key} has shape {shape}, but input_ids has {tokens} tokens: one row per token needed"
            )
    found = (int(data["hidden_states"].shape[1]), int(data["verifier_last_hidden_states"].shape[1]))
    if widths is not None and found != tuple(widths):
        raise SampleFileError(
            f"hidden states {found[0]} wide (fused) and {found[1]} (last layer), the other samples' "
            f"{widths[0]} and {widths[1]}: other captured layers or another model; regenerate it"
        )


def sample_widths(
    path: str | os.PathLike, standardize_fn: StandardizeFnSig = standardize_data_v1
) -> tuple[int, int]:
    """(fused, teacher) widths of one sample file, from its shapes (meta tensors, no math)."""
    from speculators_vllm016.data_generation.sample_io import load_sample

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to("meta")
        if isinstance(value, (list, tuple)):
            return [meta(item) for item in value]
        return value

    raw = stored_states.payload_as_states(load_sample(path, mmap=True, dequantize=False))
    data = standardize_fn(
        {key: meta(raw[key]) for key in ("input_ids", "hidden_states", "loss_mask")}
    )
    return int(data["hidden_states"].shape[-1]), int(data["verifier_last_hidden_states"].shape[-1])


def shift_batch(batch: BatchType, *, legacy_loss_mask_shift: bool = False) -> BatchType:
    """Pair the states of token t with token t + 1 (one sample, unbatched; length drops by one).

    The loss mask is taken two tokens ahead: position t predicts token t + 2. With
    `legacy_loss_mask_shift=True` it is taken one token ahead, as 0.3.0 did.
    """
    loss_mask = batch["loss_mask"]
    if legacy_loss_mask_shift:
        shifted_mask = loss_mask[1:]
    else:
        shifted_mask = torch.cat([loss_mask[2:], loss_mask.new_zeros(min(1, len(loss_mask) - 1))])
    shifted = {
        "input_ids": batch["input_ids"][1:],
        "hidden_states": batch["hidden_states"][:-1],
        "verifier_last_hidden_states": batch["verifier_last_hidden_states"][1:],
        "loss_mask": shifted_mask,
        "lengths": batch["lengths"] - 1,
        "position_ids": batch["position_ids"][1:],
    }
    return stored_states.shift_scales(batch, shifted)


def _read_length(path: Path) -> int:
    """Tokens in one sample file, read from its header (no hidden states are loaded)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return int(handle.get_slice("input_ids").get_shape()[0])
    data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(data["input_ids"].shape[0])


def _manifest_lengths(folders: set[Path]) -> dict[Path, tuple[int, int]]:
    """`{file: (tokens, bytes)}` from datagen's manifests in `folders`, where datagen wrote one."""
    try:
        from speculators_vllm016.data_generation.manifest import read_manifest
    except ImportError:  # a datagen without manifests
        return {}
    known: dict[Path, tuple[int, int]] = {}
    for folder in folders:
        for name, record in read_manifest(folder).items():
            known[folder / name] = (int(record.length), int(record.bytes))
    return known


def sample_lengths(
    files: Sequence[str | os.PathLike], num_threads: int = 8
) -> tuple[list[int], list[tuple[Path, str]]]:
    """Token count of every sample file, and the files that could not be read with the reason.

    A manifest record is trusted when the file's size matches it; other files are opened (header
    only, in parallel threads).
    """
    paths = [Path(name) for name in files]
    known = _manifest_lengths({path.parent for path in paths})
    lengths: list[int] = [-1] * len(paths)
    to_read: list[int] = []
    for position, path in enumerate(paths):
        record = known.get(path)
        try:
            size = path.stat().st_size
        except OSError:
            size = -1
        if record is not None and record[1] == size:
            lengths[position] = record[0]
        else:
            to_read.append(position)
    failures: list[tuple[Path, str]] = []

    def read(position: int) -> tuple[int, int | None, str | None]:
        try:
            return position, _read_length(paths[position]), None
        except Exception as error:  # noqa: BLE001 - any unreadable file is reported, not fatal
            return position, None, type_and_first_line(error)[:200]

    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        for position, length, reason in pool.map(read, to_read):
            if length is None:
                failures.append((paths[position], reason or "unreadable"))
            else:
                lengths[position] = length
    return lengths, failures


def _file_index(path: Path) -> int:
    match = SAMPLE_FILE.match(path.name)
    return int(match.group(1)) if match else -1


def prepare_sample(
    raw: dict[str, Any],
    index: int,
    *,
    name: str,
    standardize_fn: StandardizeFnSig = standardize_data_v1,
    hidden_states_dtype: torch.dtype = torch.float,
    transform: TransformTensors | None = None,
    seed: int = 0,
    epoch: int = 0,
    legacy_loss_mask_shift: bool = False,
    output_dtype: torch.dtype | None = None,
    widths: tuple[int, int] | None = None,
    keep_fp8: bool = False,
) -> BatchType:
    """One raw sample (a file's dict, or the generator's result) -> the shifted training sample.

    The one place a sample is prepared, for files and for online extraction alike: standardize,
    check the shapes (`check_sample_shapes`, against `widths` when given), refuse non-finite
    states (`SampleFileError`), add the noise seeded by `(seed, epoch, index)` in
    `hidden_states_dtype`, store the states as `output_dtype`, shift. Without a transform the
    states go straight to `output_dtype` (or `hidden_states_dtype`): no copy when the file already
    has it. `name` says which sample in error messages.

    A sample stored as fp8 (`sample_io.FP8_KEYS`) is dequantized here, unless `keep_fp8` and no
    transform runs here: then its states stay fp8 and carry their scales (`stored_states`, in
    the dtype the states would have had), for the trainer to dequantize on its device.
    """
    from speculators_vllm016.data_generation.sample_io import dequantized_sample, is_fp8_sample

    fp8 = is_fp8_sample(raw)
    if fp8 and not (keep_fp8 and transform is None):
        raw, fp8 = dequantized_sample(raw), False
    try:
        data = stored_states.standardize_fp8(raw, standardize_fn) if fp8 else standardize_fn(raw)
        check_sample_shapes(data, widths)
    except SampleFileError as error:
        raise SampleFileError(f"{name}: {error}") from None
    except Exception as error:  # noqa: BLE001 - a malformed sample surfaces here, in a worker
        raise SampleFileError(f"{name}: unreadable ({type(error).__name__}: {error})") from None
    for key in ("hidden_states", "verifier_last_hidden_states"):
        if not stored_states.states_finite(data, key):
            raise SampleFileError(f"{name}: {key} holds NaN or inf values")
    working = (
        hidden_states_dtype if transform is not None else (output_dtype or hidden_states_dtype)
    )
    data = {
        key: value.to(working)
        if "hidden_states" in key and not stored_states.is_fp8(value)
        else value
        for key, value in data.items()
    }
    length = int(data["input_ids"].shape[0])
    data["lengths"] = torch.tensor([length], dtype=torch.long)
    data["position_ids"] = torch.arange(length, dtype=torch.long)
    if transform is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(noise_seed(seed, epoch, index))
            data = transform(data)
    if output_dtype is not None and transform is not None:
        # After the noise, so only the finished values are rounded (what autocast would do).
        data = {
            key: value.to(output_dtype) if "hidden_states" in key else value
            for key, value in data.items()
        }
    return shift_batch(data, legacy_loss_mask_shift=legacy_loss_mask_shift)


class Eagle3SampleFileDataset(Dataset):
    """Standardized, shifted samples read from sample files (one file per sample).

    Item `i` is the shifted sample dict of `file_list[i]`, or None when the file turns out unusable
    (unreadable, or hidden states that are not finite) and `strict` is off: the collate function
    drops it and counts it. The transform (noise) is seeded per `(seed, epoch, index)`, so a sample
    gets the same noise whatever worker reads it and whenever: resumed runs see the same data.
    `lengths` are the shifted token counts that packing uses. Hidden states are checked in the
    file's dtype; a noise drawn here is added in `hidden_states_dtype` (fp32, as 0.3.0);
    `output_dtype` (bf16 for bf16 training) is what rows store: bf16 files then stay bf16 without
    a copy, halving the bytes pinned and copied to the GPU at no loss (autocast rounds the fused
    states to bf16 before the first layer anyway).
    `widths` (fused, teacher) is what every sample must have (the model's); by default, when the
    files are scanned (`lengths` not given), the widths of the lowest-index readable file.

    fp8 files are dequantized here, or with `device_dequantize=True` (the trainer's offline
    loader) on the training device: items then hold fp8 states and scales (`prepare_sample`).

    With `device_noise=True` (the trainer's offline loader) items are not noised here: each carries
    its `sample_index`, the packed row its `sample_indices`, and `SampleFileLoader` attaches the
    `RowNoise` that the trainer applies on the training device. Nothing an item holds then depends
    on the epoch, so persistent workers (which never see `set_epoch`) read the same items.
    """

    def __init__(
        self,
        max_len: int,
        datapath: str | None = None,
        file_list: list[str] | None = None,
        transform: TransformTensors | None = None,
        hidden_states_dtype: torch.dtype = torch.float,
        standardize_fn: StandardizeFnSig = standardize_data_v1,
        *,
        lengths: Sequence[int] | None = None,
        seed: int = 0,
        strict: bool = False,
        legacy_loss_mask_shift: bool = False,
        output_dtype: torch.dtype | None = None,
        widths: tuple[int, int] | None = None,
        device_noise: bool = False,
        device_dequantize: bool = False,
    ) -> None:
        if (datapath is None) == (file_list is None):
            raise InvalidInputError(
                "give exactly one of `datapath` (a folder to scan) or `file_list`"
            )
        files = list_files(datapath) if datapath is not None else [Path(f) for f in file_list]
        self.max_len = max_len
        self.transform = transform
        self.hidden_states_dtype = hidden_states_dtype
        self.standardize_fn = standardize_fn
        self.seed = seed
        self.epoch = 0
        self.strict = strict
        self.legacy_loss_mask_shift = legacy_loss_mask_shift
        self.output_dtype = output_dtype
        self.device_noise = device_noise
        self.device_dequantize = device_dequantize
        self.unreadable: list[tuple[Path, str]] = []
        if lengths is None:
            raw, self.unreadable = sample_lengths(files)
            if self.unreadable and strict:
                path, reason = self.unreadable[0]
                raise SampleFileError(
                    f"{len(self.unreadable)} sample files cannot be read, e.g. {path} ({reason}); "
                    "delete or regenerate them, or drop --strict-data to skip them"
                )
            for path, reason in self.unreadable[:20]:
                logger.warning("skipping unreadable sample file %s (%s)", path, reason)
            kept = [(f, n) for f, n in zip(files, raw, strict=True) if n >= 0]
            files = [f for f, _ in kept]
            lengths = [max(n - 1, 0) for _, n in kept]
            if widths is None:
                widths = self._reference_widths(files)
        elif len(lengths) != len(files):
            raise InvalidInputError(f"{len(lengths)} lengths for {len(files)} files")
        self.widths = None if widths is None else (int(widths[0]), int(widths[1]))
        self.data: list[Path] = files
        self.lengths: list[int] = [int(n) for n in lengths]

    def _reference_widths(self, files: list[Path]) -> tuple[int, int] | None:
        """The widths of the lowest-index readable file (shapes only), the others' yardstick."""
        for path in sorted(files, key=lambda f: (str(f.parent), _file_index(f), f.suffix)):
            try:
                return sample_widths(path, self.standardize_fn)
            except Exception:  # noqa: BLE001 - an unusable file is refused when it is read
                continue
        return None

    @property
    def approx_lengths(self) -> list[int]:
        """0.3.0's name; the lengths here are exact."""
        return self.lengths

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def row_noise(self) -> RowNoise | None:
        """The noise of this epoch's rows when it is drawn on the device; None otherwise."""
        if not self.device_noise or self.transform is None:
            return None
        return RowNoise(self.transform, self.seed, self.epoch)

    def __len__(self) -> int:
        return len(self.data)

    def load(self, index: int) -> BatchType:
        """The shifted sample of file `index`; raises `SampleFileError` when it is unusable."""
        from speculators_vllm016.data_generation.sample_io import load_sample

        path = self.data[index]
        try:
            raw = load_sample(path, mmap=True, dequantize=not self.device_dequantize)
        except Exception as error:  # noqa: BLE001 - a corrupt file surfaces here, in a worker
            raise SampleFileError(f"{path}: unreadable ({type(error).__name__}: {error})") from None
        return self.prepare(raw, index, str(path))

    def prepare(self, raw: dict[str, Any], index: int, name: str) -> BatchType:
        """`prepare_sample` with this dataset's settings (epoch, seed, transform, dtype)."""
        deferred = self.device_noise and self.transform is not None
        sample = prepare_sample(
            raw,
            index,
            name=name,
            standardize_fn=self.standardize_fn,
            hidden_states_dtype=self.hidden_states_dtype,
            transform=None if deferred else self.transform,
            seed=self.seed,
            epoch=self.epoch,
            legacy_loss_mask_shift=self.legacy_loss_mask_shift,
            output_dtype=self.output_dtype,
            widths=self.widths,
            keep_fp8=self.device_dequantize,
        )
        if deferred:
            sample["sample_index"] = int(index)
        return sample

    def __getitem__(self, index: int) -> BatchType | None:
        return self.item(index)

    def item(self, index: int, raw: dict[str, Any] | None = None) -> BatchType | None:
        """Sample `index` prepared from `raw` (given: online extraction) or from its file;
        None when unusable and `strict` is off."""
        try:
            return (
                self.load(index) if raw is None else self.prepare(raw, index, str(self.data[index]))
            )
        except SampleFileError as error:
            if self.strict:
                raise
            logger.warning("skipping sample: %s", error)
            return None


RowBuffer = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
"""Where a packed row's tensor is written: `(key, shape, dtype)` -> an uninitialized tensor."""


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in shared memory (a loader worker's rows reach the main process
    as a handle to it, not as a copy)."""
    numel = 1
    for size in shape:
        numel *= size
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(numel)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def new_row_buffer(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for a packed row; in a loader worker, in shared memory already, so
    the hand-off to the main process sends a handle instead of copying the row once more."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    return shared_empty(shape, dtype)


def _pack(key: str, parts: list[torch.Tensor], max_len: int, buffer: RowBuffer) -> torch.Tensor:
    """`parts` laid end to end, cut or zero-padded to `max_len` rows, in one copy; [1, max_len, ...]."""
    row = buffer(key, (max_len, *parts[0].shape[1:]), parts[0].dtype)
    used = 0
    for part in parts:
        take = min(int(part.shape[0]), max_len - used)
        if take <= 0:
            break
        row[used : used + take].copy_(part[:take])
        used += take
    if used < max_len:
        row[used:].zero_()
    return row[None]


def pack_samples(
    samples: list[BatchType | None], max_len: int, buffer: RowBuffer = new_row_buffer
) -> PackedBatch:
    """Pack shifted samples into one row of `max_len` tokens (see `create_collate_fn`), each
    tensor written where `buffer` says (a fresh tensor by default; a reused host slot for
    `row_slots`)."""
    usable = [sample for sample in samples if sample is not None]
    skipped = torch.tensor(len(samples) - len(usable), dtype=torch.long)
    if not usable:
        return {"skipped_samples": skipped}  # type: ignore[typeddict-item]
    keys = set(usable[0])
    if any(set(sample) != keys for sample in usable[1:]):
        raise SampleFileError(
            "one packed row holds samples stored as fp8 and others stored as bf16; train on "
            "folders of one --storage-dtype"
        )
    row: dict[str, Any] = {}
    for key in usable[0]:
        if key == "sample_index":
            continue
        parts = [sample[key] for sample in usable]
        row[key] = torch.cat(parts) if key == "lengths" else _pack(key, parts, max_len, buffer)
    kept: list[int] = []
    used = 0
    for length in row["lengths"].tolist():
        if used + length >= max_len:
            kept.append(max_len - used)
            break
        kept.append(length)
        used += length
    row["lengths"] = torch.tensor(kept, dtype=torch.long)
    if "sample_index" in usable[0]:
        row["sample_indices"] = torch.tensor(
            [sample["sample_index"] for sample in usable[: len(kept)]], dtype=torch.long
        )
    if skipped:
        row["skipped_samples"] = skipped
    return row  # type: ignore[return-value]


def create_collate_fn(max_len: int) -> Callable[[list[BatchType | None]], PackedBatch]:
    """Pack a list of shifted samples into one row of `max_len` tokens (see `PackedBatch`).

    Samples are laid end to end; the row is cut or zero-padded to `max_len`, and `lengths` lists
    the samples that fit, the last one cut to what is left. None entries (unusable samples) are
    dropped and counted in `skipped_samples`; when all are, the row is that count alone (the
    trainer steps on its empty row: see the module docstring). Samples that carry their
    `sample_index` (noise drawn on the device) give the row `sample_indices`, one per entry of
    `lengths`.
    """

    def collate(samples: list[BatchType | None]) -> PackedBatch:
        return pack_samples(samples, max_len)

    return collate
