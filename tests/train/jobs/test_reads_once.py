"""A training job reads its inputs once (#49 item 2): the verifier's config.json and safetensors,
the data folder's record and first sample, a `--from-pretrained` draft's config and weights are
each opened once by `prepare` + `build_model`; every check after that is a function of what was
read (`VerifierInfo`, `DataFolder`, `PretrainedDraft`).

Counted by wrapping the functions that open files (`open`, `safetensors.safe_open`,
`torch.load`) and keeping the openings of files inside the verifier, data and draft folders,
each with the stack that opened it."""

from __future__ import annotations

import builtins
import contextlib
import io
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors
import torch

from speculators_vllm016.cli.train import config_from_argv
from speculators_vllm016.train.jobs.draft_build import build_model
from speculators_vllm016.train.jobs.setup import prepare
from tests.training_fixtures import train_args

# vLLM's `get_config` (train reads the verifier's config object through it, once) opens
# config.json twice itself; those openings are vLLM's, counted apart.
_VLLM_CONFIG = "vllm/transformers_utils/config.py"


class Openings:
    """Openings of files under the watched folders, as `label:relative/path`."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = {label: folder.resolve() for label, folder in folders.items()}
        self.ours: Counter[str] = Counter()
        self.vllm: Counter[str] = Counter()
        self.stacks: dict[str, list[str]] = {}

    def note(self, file: object) -> None:
        try:
            path = Path(file).resolve()  # type: ignore[arg-type]
        except TypeError:
            return
        for label, folder in self.folders.items():
            if folder in path.parents:
                key = f"{label}:{path.relative_to(folder)}"
                stack = "".join(traceback.format_stack(limit=12)[:-2])
                (self.vllm if _VLLM_CONFIG in stack else self.ours)[key] += 1
                self.stacks.setdefault(key, []).append(stack)

    def why(self, key: str) -> str:
        return "\n---\n".join(self.stacks.get(key, []))


@contextlib.contextmanager
def counting(folders: dict[str, Path]) -> Iterator[Openings]:
    seen = Openings(folders)
    real_open, real_safe_open, real_load = builtins.open, safetensors.safe_open, torch.load

    def opened(file, *args, **kwargs):
        seen.note(file)
        return real_open(file, *args, **kwargs)

    def safe_opened(file, *args, **kwargs):
        seen.note(file)
        return real_safe_open(file, *args, **kwargs)

    def loaded(file, *args, **kwargs):
        seen.note(file)
        return real_load(file, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(builtins, "open", opened)
        patch.setattr(io, "open", opened)
        patch.setattr(safetensors, "safe_open", safe_opened)
        patch.setattr(torch, "load", loaded)
        yield seen
    finally:
        patch.undo()


def _set_up(args: list[str], folders: dict[str, Path]) -> Openings:
    config, _ = config_from_argv(args)
    with counting(folders) as seen:
        setup = prepare(config)
        build_model(config, setup)
    # Read once, and not kept: the draft holds its copies (a 1T target's head is gigabytes).
    assert setup.verifier is not None and not setup.verifier._tensors
    return seen


# The verifier's single safetensors file: its header listed once, then its final norm and LM head
# (the fingerprint) and its embeddings (the draft's copy), each tensor read once.
VERIFIER_READS = {"verifier:config.json": 1, "verifier:model.safetensors": 3}
# data_0.pt: opened, then torch.load; .datagen_state.json: the completeness record (absent here).
DATA_READS = {"data:data_config.json": 1, "data:data_0.pt": 2, "data:.datagen_state.json": 1}


def _assert_once(seen: Openings, expected: dict[str, int]) -> None:
    for key in {**expected, **seen.ours}:
        assert seen.ours[key] == expected.get(key, 0), f"{key}: {seen.ours[key]}\n{seen.why(key)}"
    # vLLM's get_config, called once: it opens config.json twice itself.
    assert dict(seen.vllm) == {"verifier:config.json": 2}


def test_a_training_job_reads_its_verifier_and_data_once(tiny_llama, training_data, tmp_path):
    args = train_args(tiny_llama, training_data, tmp_path / "save")
    seen = _set_up(args, {"verifier": tiny_llama, "data": training_data})
    _assert_once(seen, {**VERIFIER_READS, **DATA_READS})


@pytest.fixture
def small_draft(tiny_llama, training_data, tmp_path) -> Path:
    """A draft in this package's layout: the job's initial draft, saved."""
    config, _ = config_from_argv(train_args(tiny_llama, training_data, tmp_path / "first"))
    model = build_model(config, prepare(config))
    model.save_pretrained(tmp_path / "draft")
    return tmp_path / "draft"


def test_a_fine_tune_reads_its_draft_once(tiny_llama, training_data, small_draft, tmp_path):
    args = train_args(tiny_llama, training_data, tmp_path / "save", "--from-pretrained")
    args.append(str(small_draft))
    folders = {"verifier": tiny_llama, "data": training_data, "draft": small_draft}
    seen = _set_up(args, folders)
    draft_reads = {"draft:config.json": 1, "draft:model.safetensors": 1}
    # The embeddings compared with the draft's are the ones the draft then copies: read once.
    _assert_once(seen, {**VERIFIER_READS, **DATA_READS, **draft_reads})
