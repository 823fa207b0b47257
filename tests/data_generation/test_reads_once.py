"""Datagen's set-up reads its inputs once (#49 item 2): the target's config.json is read once
(`preflight.inspect_model` -> `ModelFacts`) and every check after it, the engine's start (its CPU
defaults, `engine_setup.build_engine`) and the fingerprint in data_config.json use that reading;
the target's safetensors are listed once and its final norm and LM head read once (the
fingerprint); the chat data and the output folder's records once each.

Counted with `tests.reads_once.counting` (what our code and each library open). The run itself
uses a stand-in engine (no vLLM); the engine's start is followed up to where the model goes to
vLLM's workers, with what vLLM's own config reading opens pinned apart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speculators_vllm016.data_generation import engine_setup, offline
from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.preflight import ModelFacts, inspect_model
from speculators_vllm016.data_generation.vllm_hidden_states_generator import HiddenStatesResult
from speculators_vllm016.demo import demo_conversations_path
from tests.reads_once import assert_counts, counting

ROWS = 6


class StandIn:
    """An engine's answers without vLLM: zeros of the target's width, float32."""

    def __init__(self, facts: ModelFacts) -> None:
        self.model_path, self.hidden_size = facts.path, facts.hidden_size
        self.layer_ids, self.dtype, self.tensor_parallel_size = facts.layer_ids, torch.float32, 1
        cache = SimpleNamespace(gpu_memory_utilization=0.5)
        self.vllm_config = SimpleNamespace(cache_config=cache)

    def generate_stream(self, sequences):
        for k, ids in enumerate(sequences):
            states = torch.zeros(len(self.layer_ids), len(ids), self.hidden_size)
            yield k, HiddenStatesResult(torch.tensor(ids), list(states.unbind(0)))

    def close(self) -> None:
        pass


@pytest.fixture
def job(tiny_llama, tmp_path) -> SimpleNamespace:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:ROWS]) + "\n")
    options = DatagenOptions(
        target_model_path=str(tiny_llama),
        train_data_path=str(chats),
        output_dir=str(tmp_path / "out"),
        seq_length=64,
        batch_size=4,
        dtype="float32",
        hf_cache_dir=str(tmp_path / "hf"),
        num_preprocessing_workers=1,
        show_progress=False,
    )
    folders = {"target": Path(tiny_llama), "chats": chats, "out": tmp_path / "out"}
    return SimpleNamespace(options=options, folders=folders)


# The tokenizer (one AutoTokenizer.from_pretrained) and the chat data (one load_dataset) as the
# libraries read them; ours: the chat file's UTF-8 check.
LIBRARY_READS = {
    "transformers": {"target:tokenizer_config.json": 3, "target:chat_template.jinja": 1},
    "datasets": {"chats": 6},
}
# config.json once (inspect_model); the safetensors listed once, then the final norm and LM head
# read once (the fingerprint in data_config.json); this shard's manifest once (what is present).
FIRST_RUN = {
    "target:config.json": 1,
    "target:model.safetensors": 2,
    "chats": 1,
    "out:manifest/shard-0-of-1.jsonl": 1,
}


def test_a_datagen_run_reads_its_inputs_once(job):
    facts = inspect_model(job.options.target_model_path, None)
    with counting(job.folders) as seen:
        run_datagen(job.options, generator=StandIn(facts))
    assert_counts(seen, {"ours": FIRST_RUN, **LIBRARY_READS})


def test_a_resumed_run_reads_its_record_and_each_kept_file_once(job):
    facts = inspect_model(job.options.target_model_path, None)
    run_datagen(job.options, generator=StandIn(facts))
    assert len(list(job.folders["out"].glob("data_*.pt"))) == ROWS
    with counting(job.folders) as seen:
        run_datagen(job.options, generator=StandIn(facts))
    # Nothing left to compute: no fingerprint read, no data_config.json written. The manifest
    # lists every file with its size: only the first is opened (what its tensors are).
    ours = {
        "target:config.json": 1,
        "chats": 1,
        "out:.datagen_state.json": 1,
        "out:manifest/shard-0-of-1.jsonl": 1,
        "out:data_0.pt": 2,  # opened, then torch.load (memory-mapped)
    }
    # The chat data's dataset is in the datasets cache since the first run: not read again.
    assert_counts(seen, {"ours": ours, "transformers": LIBRARY_READS["transformers"]})


# vLLM's config of the target (`EngineArgs.create_engine_config`: its `get_config` and the
# checks around it) opens config.json three times itself; the tokenizer is the workers'.
VLLM_CONFIG_READS = {"target:config.json": 3}


class HandedToWorkers(Exception):
    """Raised where the engine's start hands the model to vLLM's workers."""


def _stop(_vllm_config):
    raise HandedToWorkers


def test_the_engine_start_reads_nothing_datagen_read(job, monkeypatch):
    """From `run_datagen`'s reading to vLLM's executor: our code opens nothing of the target
    (the CPU defaults and the engine settings use the `ModelFacts` read once); vLLM's own config
    reading (`EngineArgs.create_engine_config`) opens config.json and the tokenizer's files."""
    monkeypatch.setattr(engine_setup, "_make_executor", _stop)
    with counting(job.folders) as seen:
        facts = inspect_model(job.options.target_model_path, None)
        with pytest.raises(HandedToWorkers):
            offline.start_generator(job.options, facts)
    assert_counts(seen, {"ours": {"target:config.json": 1}, "vllm": VLLM_CONFIG_READS})


def test_a_one_pass_run_hands_its_reading_to_the_extraction(job, monkeypatch, tmp_path):
    """`datagen --regenerate`: the checks before the engine read config.json once and the
    extraction half uses that reading (it used to read it again)."""
    from contextlib import nullcontext

    from speculators_vllm016.data_generation.regeneration import one_pass
    from speculators_vllm016.data_generation.regeneration.options import (
        RegenerateOptions,
        SamplingOptions,
    )

    chats = job.options.preprocessing.train_data_path
    # The regeneration half (its own tests) stands in: its "answers" are the chat data.
    monkeypatch.setattr(one_pass, "capture_paused", lambda generator: nullcontext())
    monkeypatch.setattr(one_pass, "GeneratorEngine", lambda generator: None)
    monkeypatch.setattr(
        one_pass, "run_regeneration", lambda options, engine: SimpleNamespace(output_file=chats)
    )
    regenerate = RegenerateOptions(
        job.options.target_model_path,
        chats,
        str(tmp_path / "regenerated"),
        sampling=SamplingOptions(max_tokens=64),
        max_prompt_tokens=256,
    )
    facts = inspect_model(job.options.target_model_path, None)
    with counting(job.folders) as seen:
        one_pass.run_datagen_regenerating(job.options, regenerate, generator=StandIn(facts))
    assert_counts(seen, {"ours": FIRST_RUN, **LIBRARY_READS})


def _regenerate_argv(job, tmp_path) -> list[str]:
    options = job.options
    return [
        "--target-model-path",
        options.target_model_path,
        "--train-data-path",
        options.preprocessing.train_data_path,
        "--output-dir",
        str(tmp_path / "regenerated"),
    ]


def test_regenerate_reads_the_target_config_once_before_its_engine(job, tmp_path, monkeypatch):
    """`speculators regenerate`: the lengths are fitted to the model's context from its
    config.json, and the engine's start (its context check, CPU defaults) uses that reading."""
    import vllm

    from speculators_vllm016.cli import regenerate
    from speculators_vllm016.data_generation.regeneration.local_engine import LocalEngine

    def stop(*args, **kwargs):
        raise HandedToWorkers

    monkeypatch.setattr(vllm, "LLM", stop)
    args = regenerate.build_parser().parse_args(_regenerate_argv(job, tmp_path))
    with counting(job.folders) as seen:
        options = regenerate.regenerate_options_from_args(args)
        with pytest.raises(HandedToWorkers):
            LocalEngine(options)
    assert_counts(seen, {"transformers": {"target:config.json": 1}})


def test_datagen_regenerate_reads_the_target_config_once_before_its_engine(job, tmp_path):
    """`datagen --regenerate`: the reading that fitted the lengths is the one its checks use."""
    from speculators_vllm016.cli import datagen
    from speculators_vllm016.data_generation.regeneration.one_pass import prepare_one_pass

    argv = [*_regenerate_argv(job, tmp_path), "--seq-length", "64", "--regenerate"]
    args = datagen.build_parser().parse_args(argv)
    with counting(job.folders) as seen:
        _, facts = prepare_one_pass(
            datagen.options_from_args(args), datagen.regeneration_options(args)
        )
    assert facts.num_layers > 0
    assert_counts(seen, {"transformers": {"target:config.json": 1}})
