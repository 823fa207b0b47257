"""A training job reads its inputs once (#49 item 2): the verifier's config.json and safetensors,
the data folder's record and first sample, a `--from-pretrained` draft's config and weights are
each opened once by `prepare` + `build_model`; every check after that is a function of what was
read (`VerifierInfo`, `DataFolder`, `PretrainedDraft`).

Counted with `tests.reads_once.counting` (the openings of files inside the verifier, data and
draft folders, each with the stack that opened it, put down to our code or the library that
made them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators_vllm016.cli.train import config_from_argv
from speculators_vllm016.train.jobs.draft_build import build_model
from speculators_vllm016.train.jobs.setup import prepare
from tests.reads_once import Openings, assert_counts, counting
from tests.training_fixtures import train_args


def _set_up(args: list[str], folders: dict[str, Path]) -> Openings:
    config, _ = config_from_argv(args)
    with counting(folders) as seen:
        setup = prepare(config)
        build_model(config, setup)
    # Read once, and not kept: the draft holds its copies (a 1T target's head is gigabytes).
    assert setup.verifier is not None and not setup.verifier._tensors
    return seen


# The verifier's single safetensors file: its header listed once, then its final norm and LM head
# (the fingerprint) and its embeddings (the draft's copy), each tensor read once. Its config.json
# is read once by us (through transformers' `get_config_dict`) and once by vLLM's `get_config`
# (the config object; it opens the file twice itself).
VERIFIER_READS = {"verifier:model.safetensors": 3}
LIBRARY_READS = {
    "transformers": {"verifier:config.json": 1},
    "vllm": {"verifier:config.json": 2},
}
# data_0.pt: opened, then torch.load; .datagen_state.json: the completeness record (absent here).
DATA_READS = {"data:data_config.json": 1, "data:data_0.pt": 2, "data:.datagen_state.json": 1}


def _assert_once(seen: Openings, ours: dict[str, int], libraries=LIBRARY_READS) -> None:
    assert_counts(seen, {"ours": ours, **libraries})


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
