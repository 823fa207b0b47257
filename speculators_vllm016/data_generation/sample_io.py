"""Sample files on disk: atomic writes, reading back, and what a resumed run still has to do.

A sample appears under its final name only once it is whole: it is written to a temporary file,
flushed to disk, and renamed. Each writing process owns a folder `.tmp/<writer id>/` of the output
folder and holds a lock on it while it lives; at start a run removes only the folders whose lock
nobody holds (their writer died), so shards that share one output folder never delete each other's
files. A crash (even SIGKILL) leaves at most such a folder, which the next run deletes.
A sample written without a writer folder (`write_sample`) goes through `utils.atomic_files`, whose
temporary `.data_{idx}.pt.{hex8}.tmp` beside the target the next run's sweep removes too.

What a sample holds (the contract every consumer relies on; `data_config.json` records it too):
`hidden_states[k]` is the residual stream after decoder layer `layer_ids[k]` (the layer's output
plus its residual input, as `layer_capture.residual_stream` computes it), taken BEFORE the model's
final norm: no captured state is ever normalized. The last captured layer (the model's last
decoder layer by default) is the input of the final norm, so `lm_head(final_norm(state))` of it
is the verifier's own logits; the trainer applies the verifier's frozen final norm and LM head to
it to make its targets (`Eagle3DraftModel.target_logits`).

With `--storage-dtype fp8` (`utils.fp8_storage`) a file holds the states as `hidden_states_fp8`
(one e4m3 tensor per layer), `hidden_states_scale` (one fp32 `[T, 1]` per layer) and
`hidden_states_dtype` (the engine's dtype, as text) instead of `hidden_states`: 0.3.0's trainer,
which reads `data["hidden_states"]`, stops with `KeyError: 'hidden_states'` instead of training on
bytes it cannot interpret. `load_sample` gives such a file back in the 0.3.0 layout (dequantized
to the engine's dtype), or as stored (`dequantize=False`: the trainer's own loader, which turns
the states back on the training device).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.utils.atomic_files import (
    TEMP_SUFFIX,
    WriteErrorKeeper,
    atomic_write,
    real_write_errors,
)
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.file_lock import try_lock_file
from speculators_vllm016.utils.fp8_storage import STORAGE_DTYPES, quantize
from speculators_vllm016.utils.fp8_storage import dequantize as dequantize_layer

if TYPE_CHECKING:  # torch is imported where a sample is read or written: `--help` needs none
    import torch

__all__ = [
    "SAMPLE_FILE",
    "SAMPLE_PATTERNS",
    "FP8_KEYS",
    "WriterSlot",
    "WrittenFile",
    "dequantized_sample",
    "is_fp8_sample",
    "load_sample",
    "quantized_sample",
    "remove_partial_files",
    "sample_bytes",
    "sample_path",
    "write_sample",
    "write_sample_file",
]

# The one home of the sample-file name: datagen writes it, the trainer and resume read it.
SAMPLE_PATTERNS = {"pt": "data_{idx}.pt", "safetensors": "data_{idx}.safetensors"}
SAMPLE_FILE = re.compile(r"^data_(\d+)\.(pt|safetensors)$")  # group 1: index, group 2: format
_SAMPLE_NAME = SAMPLE_FILE  # the private name resume.py and earlier callers used
_TEMP_PREFIX = ".tmp-"  # temporary files of earlier versions, beside the samples
# `utils.atomic_files`' temporary of a sample written without a writer folder (`write_sample`).
_LOOSE_TEMP = re.compile(
    r"^\.data_\d+\.(pt|safetensors)\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX) + "$"
)
TEMP_DIR = ".tmp"
_LOCK_NAME = ".lock"
FP8_KEYS = ("hidden_states_fp8", "hidden_states_scale", "hidden_states_dtype")
"""A file stored as fp8 holds these keys where a bf16 file holds `hidden_states`."""
_PART_SUFFIX = ".part"  # never ends in "pt": 0.3.0's trainer reads every file ending in "pt"


class WriterSlot:
    """This process's folder for temporary sample files, locked for as long as it lives.

    The lock (flock, released by the kernel when the process dies, also over NFS) is what tells
    a later run that the folder's writer is gone; process ids are not used, since writers may
    run on other machines or in other containers.
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        root = Path(output_dir) / TEMP_DIR
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        fd = try_lock_file(self.path / _LOCK_NAME)
        assert fd is not None, "a fresh writer folder cannot be locked already"
        self._fd: int | None = fd

    def temp_for(self, final: Path) -> Path:
        return self.path / f"{uuid.uuid4().hex[:8]}-{final.name}{_PART_SUFFIX}"

    def close(self) -> None:
        """Remove the folder and release the lock (files of writes still running fail)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> WriterSlot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    bytes: int
    sha256: str


class _HashingWriter(WriteErrorKeeper):
    """A file handle that hashes what passes through it (the file is not read back)."""

    def __init__(self, handle) -> None:
        super().__init__(handle)
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return super().write(data)


def sample_path(output_dir: Path, index: int, output_format: str) -> Path:
    return output_dir / SAMPLE_PATTERNS[output_format].format(idx=index)


def _write_hashed(path: Path, write, fsync: bool, slot: WriterSlot | None = None) -> str:
    """`atomic_write` through a hashing handle; return the content's sha256.

    With a writer slot the temporary file lives in the slot's folder (swept when its writer is
    gone). A write error the serializer swallowed (torch.save's zip writer reports a position
    mismatch instead) is raised as itself, so a full disk is called one.
    """
    hashing: _HashingWriter | None = None

    def through_hash(handle) -> None:
        nonlocal hashing
        hashing = _HashingWriter(handle)
        write(hashing)

    try:
        atomic_write(
            path, through_hash, fsync=fsync, temp=None if slot is None else slot.temp_for(path)
        )
    except BaseException:
        with real_write_errors(hashing):
            raise
    assert hashing is not None
    return hashing.digest.hexdigest()


def _independent_layers(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layers as tensors with their own storage (copied only if they share one)."""
    layers = [layer.contiguous() for layer in layers]
    storages = {layer.untyped_storage().data_ptr() for layer in layers}
    if len(storages) < len(layers):
        layers = [layer.clone() for layer in layers]
    return layers


def write_sample(
    path: Path,
    sample: dict[str, Any],
    output_format: str = "pt",
    fsync: bool = False,
    storage_dtype: str = "bf16",
) -> int:
    """Write one sample atomically in the 0.3.0 layout (or as safetensors); return its bytes.

    The file appears under its name only when whole (temporary file + rename), which holds
    through a crash or SIGKILL of this process; `fsync=True` also makes it survive power loss.
    `hidden_states` are stored as independent tensors, one per captured layer; with
    `storage_dtype="fp8"` as fp8 payloads and scales (see the module docstring).
    """
    return write_sample_file(path, sample, output_format, fsync, storage_dtype=storage_dtype).bytes


def _stored_tensors(
    sample: dict[str, Any], storage_dtype: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors a file holds (pt layout: lists per layer) and its text facts."""
    import torch

    if storage_dtype not in STORAGE_DTYPES:
        raise InvalidInputError(
            f"unknown storage dtype {storage_dtype!r}; use one of {STORAGE_DTYPES}"
        )
    stored: dict[str, Any] = {
        "input_ids": torch.as_tensor(sample["input_ids"], dtype=torch.long).contiguous(),
        "loss_mask": torch.as_tensor(sample["loss_mask"], dtype=torch.long).contiguous(),
    }
    if storage_dtype == "bf16":
        if is_fp8_sample(sample):
            raise InvalidInputError("a sample quantized to fp8 cannot be stored as bf16")
        stored["hidden_states"] = _independent_layers(list(sample["hidden_states"]))
        return stored, {}
    quantized = sample if is_fp8_sample(sample) else quantized_sample(sample)
    stored["hidden_states_fp8"] = list(quantized["hidden_states_fp8"])
    stored["hidden_states_scale"] = list(quantized["hidden_states_scale"])
    return stored, {"hidden_states_dtype": str(quantized["hidden_states_dtype"])}


def quantized_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample in the 0.3.0 layout as an fp8 file stores it (`FP8_KEYS`); `write_sample_file`
    with `storage_dtype="fp8"` writes it unchanged, `dequantized_sample` turns it back."""
    layers = list(sample["hidden_states"])
    quantized = [quantize(layer) for layer in layers]
    return {
        "input_ids": sample["input_ids"],
        "hidden_states_fp8": [payload for payload, _ in quantized],
        "hidden_states_scale": [scale for _, scale in quantized],
        "hidden_states_dtype": str(layers[0].dtype).removeprefix("torch."),
        "loss_mask": sample["loss_mask"],
    }


def sample_bytes(
    num_tokens: int,
    hidden_size: int,
    num_layers: int,
    storage_dtype: str = "bf16",
    state_bytes: int = 2,
) -> int:
    """The bytes of one sample's tensors as `write_sample_file` stores them, to plan disks (a
    file adds a header of a few KB): per token, `input_ids` and `loss_mask` (int64 each) and each
    captured layer's state, `hidden_size` x `state_bytes` (the engine's dtype: 2 for bf16), or
    with `storage_dtype="fp8"` one byte a value and an fp32 scale per layer."""
    per_layer = hidden_size + 4 if storage_dtype == "fp8" else hidden_size * state_bytes
    return num_tokens * (num_layers * per_layer + 2 * 8)


def write_sample_file(
    path: Path,
    sample: dict[str, Any],
    output_format: str = "pt",
    fsync: bool = False,
    slot: WriterSlot | None = None,
    storage_dtype: str = "bf16",
) -> WrittenFile:
    """`write_sample`, with the temporary file in the writer's own folder; size and hash back."""
    import torch

    stored, facts = _stored_tensors(sample, storage_dtype)
    if output_format == "pt":
        payload = {**stored, **facts}
        digest = _write_hashed(path, lambda handle: torch.save(payload, handle), fsync, slot)
    elif output_format == "safetensors":
        from safetensors.torch import save

        tensors: dict[str, torch.Tensor] = {}
        for key, value in stored.items():
            if isinstance(value, list):
                tensors.update({f"{key}.{i}": layer for i, layer in enumerate(value)})
                count = len(value)
            else:
                tensors[key] = value
        blob = save(tensors, metadata={"num_hidden_states": str(count), **facts})
        digest = _write_hashed(path, lambda handle: handle.write(blob), fsync, slot)
    else:
        raise InvalidInputError(
            f"unknown output format {output_format!r}; use 'pt' or 'safetensors'"
        )
    return WrittenFile(path=path, bytes=path.stat().st_size, sha256=digest)


def _read_safetensors(path: Path) -> dict[str, Any]:
    """A safetensors sample in the pt layout (lists per layer, text facts as values)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    data: dict[str, Any] = {"input_ids": tensors["input_ids"], "loss_mask": tensors["loss_mask"]}
    for key in ("hidden_states", "hidden_states_fp8", "hidden_states_scale"):
        count = sum(1 for name in tensors if name.startswith(f"{key}."))
        if count:
            data[key] = [tensors[f"{key}.{i}"] for i in range(count)]
    if "hidden_states_dtype" in metadata:
        data["hidden_states_dtype"] = metadata["hidden_states_dtype"]
    return data


def is_fp8_sample(data: dict[str, Any]) -> bool:
    """Whether a sample as stored holds fp8 states (`FP8_KEYS`) rather than `hidden_states`."""
    return "hidden_states_fp8" in data


def dequantized_sample(data: dict[str, Any]) -> dict[str, Any]:
    """A stored fp8 sample in the 0.3.0 layout, its states back in the engine's dtype."""
    import torch

    dtype = getattr(torch, str(data["hidden_states_dtype"]))
    layers = [
        dequantize_layer(payload, scale, dtype)
        for payload, scale in zip(
            data["hidden_states_fp8"], data["hidden_states_scale"], strict=True
        )
    ]
    return {"input_ids": data["input_ids"], "hidden_states": layers, "loss_mask": data["loss_mask"]}


def load_sample(
    path: str | os.PathLike, mmap: bool = True, dequantize: bool = True
) -> dict[str, Any]:
    """Read a sample file of either format into the 0.3.0 dict layout.

    A file stored as fp8 comes back dequantized to the engine's dtype, or, with
    `dequantize=False`, as stored (`FP8_KEYS`), for a reader that turns it back later.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        data = _read_safetensors(path)
    else:
        import torch

        data = torch.load(path, weights_only=True, mmap=mmap)
    if dequantize and is_fp8_sample(data):
        return dequantized_sample(data)
    return data


def existing_sample_indices(output_dir: Path, output_format: str) -> set[int]:
    """Indices of whole sample files of the given format in `output_dir`."""
    if not output_dir.is_dir():
        return set()
    suffix = "pt" if output_format == "pt" else "safetensors"
    found = set()
    for entry in os.scandir(output_dir):
        match = SAMPLE_FILE.match(entry.name)
        if match and match.group(2) == suffix:
            found.add(int(match.group(1)))
    return found


def remove_partial_files(output_dir: Path) -> int:
    """Delete temporary files of writers that are gone; return how many files.

    A writer folder is removed only when its lock can be taken, i.e. its process has ended;
    live writers (other shards sharing the folder) are left alone. Loose temporaries beside the
    samples are `write_sample`'s (`.data_{idx}.pt.{hex8}.tmp`) or earlier versions' (`.tmp-*`).
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(output_dir):
        if entry.name.startswith(_TEMP_PREFIX) or _LOOSE_TEMP.match(entry.name):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    root = output_dir / TEMP_DIR
    if not root.is_dir():
        return removed
    for slot in root.iterdir():
        lock = slot / _LOCK_NAME
        if not slot.is_dir() or not lock.exists():
            continue  # being created right now, or not ours
        fd = try_lock_file(lock)
        if fd is None:
            continue  # its writer is alive
        try:
            removed += sum(1 for name in os.listdir(slot) if name != _LOCK_NAME)
            shutil.rmtree(slot, ignore_errors=True)
        finally:
            os.close(fd)
    return removed
