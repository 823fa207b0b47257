"""The datagen folder protocol: messages name the folder by its flag; data_config.json read back."""

from __future__ import annotations

import json

import pytest

from speculators_vllm016.data_generation.config_generator import (
    DataGenerationConfig,
    FormatConfig,
    HiddenStatesConfig,
    read_data_config,
)
from speculators_vllm016.data_generation.output_folder import DatagenFolder, FolderInUse
from speculators_vllm016.data_generation.resume import RunIdentity


def test_a_held_shard_is_refused_in_the_words_of_the_flag(tmp_path):
    with DatagenFolder(tmp_path, flag="--cache-dir") as first:
        first.lock()
        with pytest.raises(
            FolderInUse,
            match=rf"another process is using --cache-dir {tmp_path}; .* another --cache-dir",
        ):
            DatagenFolder(tmp_path, flag="--cache-dir").lock()
    with DatagenFolder(tmp_path, shard_index=1, num_shards=2) as first:
        first.lock()
        with pytest.raises(FolderInUse, match="for shard 1 of 2; .*another --shard-index"):
            DatagenFolder(tmp_path, shard_index=1, num_shards=2).lock()
    DatagenFolder(tmp_path, flag="--cache-dir").lock()  # released on close


def test_another_runs_folder_is_named_by_its_flag(tmp_path):
    identity = RunIdentity(compared={"samples_sha256": "a"}, informational={})
    folder = DatagenFolder(tmp_path, flag="--cache-dir", adopt_flag=None)
    assert folder.check_identity(identity) is True
    folder.record_identity(identity)
    assert folder.check_identity(identity) is False
    other = RunIdentity(compared={"samples_sha256": "b"}, informational={})
    with pytest.raises(
        ValueError,
        match=rf"^--cache-dir {tmp_path} holds samples of a different run .*another --cache-dir",
    ):
        folder.check_identity(other)
    (tmp_path / ".datagen_state.json").unlink()
    (tmp_path / "data_0.pt").write_bytes(b"")
    with pytest.raises(
        ValueError, match="no record of the run that wrote them; use an empty --cache-dir"
    ):
        folder.check_identity(identity)
    with pytest.raises(ValueError, match="no record of the run .*pass --adopt-existing"):
        DatagenFolder(tmp_path).check_identity(identity, adopt_existing=False)


def test_prepare_refuses_a_file_in_the_words_of_the_flag(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--cache-dir .*f is a file"):
        DatagenFolder(tmp_path / "f", flag="--cache-dir").prepare()
    assert DatagenFolder(tmp_path / "new").prepare() is True


def test_data_config_is_read_back_typed(tmp_path):
    assert read_data_config(tmp_path) is None
    written = DataGenerationConfig(
        version="2.0",
        hidden_states=HiddenStatesConfig(layer_ids=[2, 2, 1, 3]),
        format=FormatConfig.create_default(4, 8),
    )
    (tmp_path / "data_config.json").write_text(json.dumps(written.to_dict()))
    config = read_data_config(tmp_path)
    assert config == written
    assert config.hidden_states.before_final_norm is True


def test_older_and_partial_data_configs_stay_readable(tmp_path):
    (tmp_path / "data_config.json").write_text(
        json.dumps(
            {
                "version": "2.0",
                "hidden_states": {"layer_ids": [1, 2], "description": "x"},
                "model": 3,
            }
        )
    )
    config = read_data_config(tmp_path)
    assert config.hidden_states.layer_ids == [1, 2]
    assert config.hidden_states.before_final_norm is True  # every datagen stored pre-norm states
    assert config.model is None and config.data is None
    (tmp_path / "data_config.json").write_text("[1]")
    assert read_data_config(tmp_path) is None


def test_shards_started_together_cannot_record_two_different_runs(tmp_path):
    """#29 item 15: both shards find no record; the second to record must match the first."""
    a = RunIdentity(compared={"dtype": "float32", "samples_sha256": "s"}, informational={})
    b = RunIdentity(compared={"dtype": "bfloat16", "samples_sha256": "s"}, informational={})
    zero = DatagenFolder(tmp_path, shard_index=0, num_shards=2)
    one = DatagenFolder(tmp_path, shard_index=1, num_shards=2)
    assert zero.check_identity(a) is True and one.check_identity(b) is True
    zero.record_identity(a)
    with pytest.raises(ValueError, match=r"different run \(dtype: was 'float32', now 'bfloat16'\)"):
        one.record_identity(b)
    one.record_identity(a)  # the same run: fine
    assert json.loads((tmp_path / ".datagen_state.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".datagen_state.json"]


@pytest.mark.parametrize(("shard_index", "num_shards"), [(0, 1), (1, 2)])
def test_token_counts_go_exactly_to_token_freq_path_unless_sharded(
    tmp_path, shard_index, num_shards
):
    """0.3.0's `--token-freq-path X`: an unsharded run writes X itself (what 0.3.0 users read
    back); shard I of N writes X's name with `.shard-I-of-N` so that shards never overwrite
    each other. The counts beside the data are written either way."""
    from speculators_vllm016.data_generation.token_counts import (
        read_token_counts,
        shard_token_freq_path,
    )

    counts = {3: 2, 7: 1}
    asked = tmp_path / "elsewhere" / "freq.pt"
    asked.parent.mkdir()
    folder = DatagenFolder(tmp_path / "data", shard_index=shard_index, num_shards=num_shards)
    folder.prepare()
    folder.write_token_counts(counts, also_to=str(asked))
    expected = asked if num_shards == 1 else tmp_path / "elsewhere" / "freq.shard-1-of-2.pt"
    assert sorted(p.name for p in asked.parent.iterdir()) == [expected.name]
    assert read_token_counts(expected) == counts
    own = shard_token_freq_path(tmp_path / "data", shard_index, num_shards)
    assert read_token_counts(own) == counts


def _engine(tmp_path):
    """What `write_data_config` reads of the hidden-states generator (pure logic: no engine)."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        model_path=str(tmp_path / "target"),
        tensor_parallel_size=1,
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(gpu_memory_utilization=0.5)),
        hidden_size=8,
        layer_ids=[1, 2, 3],
        dtype=torch.float32,
    )


@pytest.mark.parametrize(
    ("flags", "recorded"),
    [
        ({}, (0, False)),
        ({"session_tokens": 300}, (300, False)),
        ({"session_tokens": 300, "sessions_only": True}, (300, True)),
    ],
)
def test_data_config_records_the_session_flags(tmp_path, monkeypatch, flags, recorded):
    """`--session-tokens` / `--sessions-only` reach data_config.json as given (train and eval read
    what the samples are from it); a record written before the fields existed reads as none."""
    from speculators_vllm016.data_generation import config_generator
    from speculators_vllm016.data_generation.options import DatagenOptions

    monkeypatch.setattr(config_generator, "_fingerprint", lambda path, config=None: "fp")
    options = DatagenOptions(
        target_model_path=str(tmp_path / "target"),
        train_data_path="chats.jsonl",
        output_dir=str(tmp_path / "out"),
        seq_length=512,
        **flags,
    )
    folder = tmp_path / "out"
    folder.mkdir()
    DatagenFolder(folder).write_data_config(_engine(tmp_path), options, 5)
    data = read_data_config(folder).data
    assert (data.session_tokens, data.sessions_only) == recorded
    assert (data.seq_length, data.num_samples) == (512, 5)
    raw = json.loads((folder / "data_config.json").read_text())
    for key in ("session_tokens", "sessions_only"):
        del raw["data"][key]
    (folder / "data_config.json").write_text(json.dumps(raw))
    older = read_data_config(folder).data
    assert (older.session_tokens, older.sessions_only) == (0, False)
