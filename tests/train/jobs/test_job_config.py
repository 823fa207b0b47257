"""The online section of the job config nests datagen's own option parts: one definition of each
setting, flat keys under `online:` as before, and the options datagen runs with built from it."""

from __future__ import annotations

import dataclasses

from speculators_vllm016.data_generation.options import (
    EngineOptions,
    OutputOptions,
    PreprocessingOptions,
)
from speculators_vllm016.train.jobs.job_config import TrainJobConfig, config_fields
from speculators_vllm016.train.jobs.job_sections import OnlineConfig
from speculators_vllm016.utils.field_docs import field_docs

ONLINE = {
    "enabled": True,
    "cache_dir": "/cache",
    "tensor_parallel_size": 2,
    "dtype": "bfloat16",
    "train_data_path": "chats.jsonl",
    "seq_length": 300,
    "data_seed": 7,
    "layer_ids": [1, 3],
    "output_format": "safetensors",
    "session_tokens": 250,
    "sessions_only": True,
}


def test_every_engine_and_preprocessing_option_of_datagen_is_an_online_key():
    """A setting added to datagen's engine or preprocessing part is a `train --online` flag
    too, with datagen's default and docstring (train's `--seed` is another setting: datagen's
    is `data_seed` here)."""
    specs = {spec.name: spec for spec in config_fields(OnlineConfig)}
    for part in (EngineOptions, PreprocessingOptions):
        docs = field_docs(part)
        for item in dataclasses.fields(part):
            name = "data_seed" if item.name == "seed" else item.name
            assert name in specs, f"datagen's {item.name} is no key of the online section"
            assert specs[name].doc.startswith(docs[item.name]), name
            if item.default is not dataclasses.MISSING:
                assert specs[name].default == item.default, name
    sample_files = [
        "output_format",
        "storage_dtype",
        "start_idx",
        "layer_ids",
        "num_writer_threads",
        "fsync",
    ]
    assert [
        name for name in specs if name in {f.name for f in dataclasses.fields(OutputOptions)}
    ] == (sample_files)


def test_the_online_keys_stay_flat_and_round_trip():
    config = TrainJobConfig.from_dict({"online": ONLINE})
    assert config.online.engine.tensor_parallel_size == 2
    assert config.online.preprocessing.seed == 7 and config.online.output.layer_ids == [1, 3]
    written = config.to_dict()["online"]
    assert all(not isinstance(value, dict) for value in written.values())
    assert {key: written[key] for key in ONLINE} == ONLINE
    assert TrainJobConfig.from_dict(config.to_dict()) == config
    assert config.flat()["data_seed"] == 7 and "seed" in config.flat()  # train's own --seed
    assert config.with_flat({"data_seed": 9}).online.preprocessing.seed == 9
    assert config.online.preprocessing.seed == 7  # with_flat copies


def test_the_online_section_gives_datagens_options():
    config = TrainJobConfig.from_dict({"online": ONLINE})
    options = config.online.datagen_options("verifier")
    assert options.engine.target_model_path == "verifier"  # None: --verifier-name-or-path
    assert options.engine.tensor_parallel_size == 2 and options.engine.dtype == "bfloat16"
    assert options.preprocessing.seed == 7 and options.seq_length == 300
    assert options.preprocessing.session_tokens == 250 and options.preprocessing.sessions_only
    assert options.output.output_dir == "/cache" and options.output.output_format == "safetensors"
    assert options.output.show_progress is False and options.output.token_freq_path is None
    options.output.layer_ids.append(5)
    assert config.online.output.layer_ids == [1, 3]  # the options share no list with the config
    options.preprocessing.seed = options.engine.tensor_parallel_size = 9  # nor any part
    assert config.online.preprocessing.seed == 7 and config.online.engine.tensor_parallel_size == 2
    assert config.online.engine.target_model_path is None  # filled in the options only
    given = TrainJobConfig.from_dict({"online": {**ONLINE, "target_model_path": "t"}})
    assert given.online.datagen_options("verifier").target_model_path == "t"
    assert TrainJobConfig().online.datagen_options("v").output.output_dir == ""


def test_online_sessions_longer_than_the_packed_row_are_refused_before_any_work():
    import pytest

    from speculators_vllm016.train.jobs.job_config import TrainSetupError
    from speculators_vllm016.train.jobs.setup import _check_online

    online = {**ONLINE, "session_tokens": 9000, "seq_length": 9000}
    config = TrainJobConfig.from_dict({"online": online, "training": {"total_seq_len": 8192}})
    with pytest.raises(TrainSetupError, match="--session-tokens 9000 is over --total-seq-len 8192"):
        _check_online(config)
