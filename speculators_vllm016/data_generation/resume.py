"""What a resumed datagen run may keep: the run's identity, and which present files are good.

The identity names what decides the bytes of every sample: the model (its path resolved), the
captured layers (defaults resolved), dtype, format and file numbering, and a hash of every
sample's token ids and loss mask. Flags that only lead to those (sequence length, seed, the
assistant pattern, the data file's path) are recorded for the error message but not compared on
their own: the hash already tells whether they changed what goes into a sample.

The flags do not settle every byte: `--dtype auto` takes the model config's dtype as the
device allows, so the same command can make other tensors (and adopted files can be anything).
Once the engine runs, its dtype and width are compared with the kept files' (`refuse_other_tensors`)
before anything is written. Nothing new is asked of the record, so folders of earlier versions
resume with the same command as before.

A folder with sample files but no identity (0.3.0 output, a deleted state file) is refused unless
the caller adopts it. Present files are trusted when the manifest lists them with their current
size; any other file is opened and its token ids compared with the sample it should hold. What
fails is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from speculators_vllm016.data_generation.manifest import ManifestWriter, SampleRecord
from speculators_vllm016.utils.atomic_files import atomic_write_json, temporary_path
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.data_generation.preflight import ModelFacts

__all__ = [
    "RunIdentity",
    "check_identity",
    "record_identity",
    "refuse_other_tensors",
    "run_identity",
    "sample_signature",
    "samples_digest",
    "verify_present",
]

logger = logging.getLogger(__name__)

STATE_FILE = ".datagen_state.json"
IDENTITY_VERSION = 2
# Changes of these change the samples, so the digest catches them; they explain a refusal.
# What a record written before a compared key existed meant by it (a folder of bf16 files).
RECORD_DEFAULTS = {"storage_dtype": "bf16"}
CAUSES = (
    "seq_length",
    "seed",
    "max_samples",
    "assistant_pattern",
    "turn_dropout",
    "chat_template_kwargs",
    "session_tokens",
    "sessions_only",
    "train_data",
)


@dataclass(frozen=True)
class RunIdentity:
    compared: dict  # must be equal for a resume
    informational: dict  # recorded, named in a refusal

    def to_json(self) -> dict:
        return {"version": IDENTITY_VERSION, **self.compared, "details": self.informational}


def run_identity(
    options: DatagenOptions, facts: ModelFacts, digest: str, num_samples: int | None = None
) -> RunIdentity:
    """The identity of a run with these options over samples whose `samples_digest` is `digest`.

    `num_samples` (every shard's samples together) is recorded, not compared (the digest covers
    it): the trainer reads it to refuse a folder that lacks some (`completeness`).
    """
    data_path = options.preprocessing.train_data_path
    data = Path(data_path)
    return RunIdentity(
        compared={
            "target_model_path": facts.path,
            "layer_ids": facts.layer_ids,
            "dtype": options.engine.dtype,
            "output_format": options.output.output_format,
            "storage_dtype": options.output.storage_dtype,
            "start_idx": options.output.start_idx,
            "num_shards": options.output.num_shards,
            "samples_sha256": digest,
        },
        informational={
            "train_data": str(data.resolve()) if data.exists() else data_path,
            "seq_length": options.preprocessing.seq_length,
            "seed": options.preprocessing.seed,
            "max_samples": options.preprocessing.max_samples,
            "assistant_pattern": options.preprocessing.assistant_pattern,
            "turn_dropout": options.preprocessing.turn_dropout,
            # None when not given: records written before the flag existed read the same.
            "chat_template_kwargs": options.preprocessing.template_kwargs() or None,
            "session_tokens": options.preprocessing.session_tokens,
            "sessions_only": options.preprocessing.sessions_only,
            "num_samples": num_samples,
        },
    )


def resolve_model_path(model: str) -> str:
    """A local folder as its absolute, resolved path; a hub id unchanged."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def samples_digest(dataset) -> str:
    """sha256 over every sample's token ids and loss mask, in order."""
    digest = hashlib.sha256()
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        digest.update(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
        digest.update(torch.as_tensor(mask, dtype=torch.int8).numpy().tobytes())
        digest.update(b"#")
    return digest.hexdigest()


def refuse_unrecorded(
    output_dir: Path,
    adopt_existing: bool,
    *,
    flag: str = "--output-dir",
    adopt_flag: str | None = "--adopt-existing",
) -> None:
    """Sample files without a record of their run are refused unless the caller adopts them.

    `flag` names the folder in the message; `adopt_flag` is the flag that adopts (None: the
    command has none, and the way out is an empty folder).
    """
    if (
        not (output_dir / STATE_FILE).exists()
        and has_sample_files(output_dir)
        and not adopt_existing
    ):
        raise InvalidInputError(_unrecorded(output_dir, flag, adopt_flag))


def _unrecorded(output_dir: Path, flag: str, adopt_flag: str | None) -> str:
    if adopt_flag is None:
        return (
            f"{flag} {output_dir} already holds sample files but no record of the run that "
            f"wrote them; use an empty {flag}"
        )
    return (
        f"{flag} {output_dir} already holds sample files but no record of the run that wrote "
        f"them (0.3.0 output, or its {STATE_FILE} was removed); pass {adopt_flag} to check and "
        f"keep those that match this run, or use an empty {flag}"
    )


def check_identity(
    output_dir: Path,
    identity: RunIdentity,
    adopt_existing: bool,
    *,
    flag: str = "--output-dir",
    adopt_flag: str | None = "--adopt-existing",
) -> bool:
    """Refuse a folder of another run; returns whether the identity still has to be recorded.

    Messages name the folder by `flag`; without an `adopt_flag` a record that cannot be read or
    compared is refused like a missing one.
    """
    state = output_dir / STATE_FILE
    if not state.exists():
        refuse_unrecorded(output_dir, adopt_existing, flag=flag, adopt_flag=adopt_flag)
        return True
    try:
        recorded = json.loads(state.read_text())
    except (OSError, ValueError) as error:
        if adopt_flag is None:
            raise InvalidInputError(_unrecorded(output_dir, flag, adopt_flag)) from None
        raise InvalidInputError(
            f"{state} is unreadable ({error}); remove it and pass {adopt_flag}"
        ) from None
    if recorded.get("version") != IDENTITY_VERSION:
        if adopt_flag is None:
            raise InvalidInputError(_unrecorded(output_dir, flag, adopt_flag))
        raise InvalidInputError(
            f"{flag} {output_dir} was written by another version of datagen; remove {STATE_FILE} "
            f"and pass {adopt_flag} to check and keep its files"
        )
    differing = {
        key: (recorded.get(key, RECORD_DEFAULTS.get(key)), value)
        for key, value in identity.compared.items()
        if recorded.get(key, RECORD_DEFAULTS.get(key)) != value
    }
    if not differing:
        return False
    details = "; ".join(f"{key}: was {old!r}, now {new!r}" for key, (old, new) in differing.items())
    if "samples_sha256" in differing:
        before = recorded.get("details", {})
        causes = [
            f"{key}: was {before.get(key)!r}, now {identity.informational.get(key)!r}"
            for key in CAUSES
            if before.get(key) != identity.informational.get(key)
        ]
        if causes:
            details += " (changed flags: " + "; ".join(causes) + ")"
    raise InvalidInputError(
        f"{flag} {output_dir} holds samples of a different run ({details}); use another {flag} "
        "or remove it"
    )


def record_identity(
    output_dir: Path,
    identity: RunIdentity,
    *,
    exclusive: bool = False,
    flag: str = "--output-dir",
    adopt_flag: str | None = "--adopt-existing",
) -> None:
    """Write the run's record. `exclusive`: only where none is yet; a record another process
    wrote since `check_identity` (shards of one folder start together) must be this run's.

    Without it two shards started at once with, say, another --dtype each found no record, both
    recorded theirs, and both wrote into one folder.
    """
    state = output_dir / STATE_FILE
    if not exclusive:
        atomic_write_json(state, identity.to_json(), indent=2, sort_keys=True)
        return
    temp = atomic_write_json(temporary_path(state), identity.to_json(), indent=2, sort_keys=True)
    try:
        os.link(temp, state)  # fails when a record is there: never replaces another's
    except FileExistsError:
        check_identity(output_dir, identity, True, flag=flag, adopt_flag=adopt_flag)
    except OSError:  # a filesystem without hard links: as before
        os.replace(temp, state)
    finally:
        temp.unlink(missing_ok=True)


def has_sample_files(output_dir: Path) -> bool:
    from speculators_vllm016.data_generation.sample_io import SAMPLE_FILE

    return output_dir.is_dir() and any(SAMPLE_FILE.match(name) for name in os.listdir(output_dir))


# What the tensors of a sample are made of: (dtype, width) of its hidden states.
Signature = tuple[str, int]


def _signature(sample: dict) -> Signature:
    first = sample["hidden_states"][0]
    return str(first.dtype), int(first.shape[-1])


def _sample_matches(path: Path, expected_ids: torch.Tensor, num_layers: int) -> Signature | None:
    """Open the file (memory-mapped) and compare what is cheap to compare; the file's
    `Signature` when it holds the expected sample, else None."""
    from speculators_vllm016.data_generation.sample_io import load_sample

    try:
        sample = load_sample(path)
        ids = torch.as_tensor(sample["input_ids"])
        states = sample["hidden_states"]
        matches = (
            torch.equal(ids.to(torch.long), expected_ids)
            and len(sample["loss_mask"]) == len(expected_ids)
            and len(states) == num_layers
            and all(layer.shape[0] == len(expected_ids) for layer in states)
        )
        return _signature(sample) if matches else None
    except Exception:  # noqa: BLE001 - any unreadable file is simply recomputed
        return None


def sample_signature(path: Path) -> Signature | None:
    """(dtype, width) of one sample file's hidden states; None when it cannot be read."""
    from speculators_vllm016.data_generation.sample_io import load_sample

    try:
        return _signature(load_sample(path))
    except Exception:  # noqa: BLE001 - an unreadable file is recomputed, not compared
        return None


def refuse_other_tensors(
    output_dir: Path,
    signatures: dict[Signature, str],
    dtype: torch.dtype | None,
    hidden_size: int,
    *,
    flag: str = "--output-dir",
) -> None:
    """Refuse to add samples to files whose hidden states differ from the engine's.

    The identity compares the flags, but some changes reach the tensors without changing a flag
    or a token id: `--dtype auto` resolved otherwise (the model's config edited, another device),
    files adopted from another run. The engine's dtype and the model's width are compared with
    those of the kept files (`signatures`: signature -> one file holding it), before any write.
    A `dtype` of None (a stand-in generator that states none) compares nothing.
    """
    if dtype is None:
        return
    wanted = (str(dtype), int(hidden_size))
    for (found_dtype, width), name in sorted(signatures.items()):
        if (found_dtype, width) != wanted:
            raise InvalidInputError(
                f"{flag} {output_dir} holds samples of a different run ({name} holds "
                f"{found_dtype} hidden states {width} wide; this run's engine makes {wanted[0]}, "
                f"{wanted[1]} wide: another --dtype, model or device); use another {flag} or "
                "remove it"
            )


def verify_present(
    output_dir: Path,
    candidates: Iterable[tuple[int, str, torch.Tensor]],
    records: dict[str, SampleRecord],
    num_layers: int,
    manifest: ManifestWriter | None,
    signatures: dict[Signature, str] | None = None,
) -> set[int]:
    """Indices whose files can be kept; `candidates` are (index, file name, expected ids).

    A file listed in the manifest with its size and token count is kept unopened; others are
    opened and checked, and those that pass get a record (without hash) so the next resume and
    the trainer find them. Failing files are left to be replaced by the recomputed ones.
    `signatures`, when given, collects what the kept files' hidden states are (one file for
    each): every opened file's, and the first unopened one's (`refuse_other_tensors`).
    """
    good: set[int] = set()
    bad: list[str] = []
    trusted_seen = False
    for index, name, expected in candidates:
        path = output_dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        record = records.get(name)
        if record is not None and record.bytes == size and record.length == len(expected):
            good.add(index)
            if signatures is not None and not trusted_seen:
                found = sample_signature(path)
                trusted_seen = found is not None
                if found is not None:
                    signatures.setdefault(found, name)
            continue
        found = _sample_matches(path, expected, num_layers)
        if found is not None:
            good.add(index)
            if signatures is not None:
                signatures.setdefault(found, name)
            if manifest is not None:
                manifest.append(SampleRecord(name, index, len(expected), size, None))
        else:
            bad.append(name)
    if bad:
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        logger.warning(
            "%d present files are damaged or belong to other data; recomputing: %s", len(bad), shown
        )
    return good
