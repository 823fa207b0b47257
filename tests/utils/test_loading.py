"""The one checkpoint reader: named tensors from local or hub folders, sharded or not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from speculators_vllm016.convert.eagle.utils import load_checkpoint_config, load_checkpoint_weights
from speculators_vllm016.utils.loading import load_model_layers, read_checkpoint_tensors

TENSORS = {
    "model.embed_tokens.weight": torch.arange(6.0).view(3, 2),
    "model.layers.0.mlp.weight": torch.ones(2, 2),
    "lm_head.weight": torch.full((3, 2), 7.0),
}


def sharded_folder(path: Path) -> Path:
    """Three shards, one tensor each, with the index transformers writes."""
    path.mkdir(parents=True)
    weight_map = {}
    for number, (name, tensor) in enumerate(TENSORS.items(), start=1):
        shard = f"model-0000{number}-of-00003.safetensors"
        save_file({name: tensor}, str(path / shard), metadata={"format": "pt"})
        weight_map[name] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_named_tensors_from_shards_single_files_and_bins(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path / "sharded")
    found = load_model_layers(["lm_head.weight", "no.such.weight"], str(folder))
    assert found.keys() == {"lm_head.weight"} and torch.equal(
        found["lm_head.weight"], TENSORS["lm_head.weight"]
    )
    single = tmp_path / "single"
    single.mkdir()
    save_file(TENSORS, str(single / "model.safetensors"))
    assert read_checkpoint_tensors(single).keys() == TENSORS.keys()
    pickled = tmp_path / "bin"
    pickled.mkdir()
    torch.save(TENSORS, pickled / "pytorch_model.bin")
    assert load_checkpoint_weights(pickled).keys() == TENSORS.keys()
    assert load_checkpoint_weights(folder).keys() == TENSORS.keys()  # shards are read too


def test_none_of_the_names_is_a_value_error(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path / "sharded")
    with pytest.raises(ValueError, match="none of the tensors"):
        load_model_layers(["missing.weight"], str(folder))
    single = tmp_path / "single"
    single.mkdir()
    save_file(TENSORS, str(single / "model.safetensors"))
    with pytest.raises(ValueError, match="none of the tensors"):
        load_model_layers(["missing.weight"], str(single))
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model_layers(["lm_head.weight"], str(tmp_path))


def test_a_hub_repo_downloads_only_the_shards_it_needs(tmp_path: Path, monkeypatch) -> None:
    """The hub is faked by a folder: what matters is which files are asked for."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    repo = sharded_folder(tmp_path / "repo")
    requested: list[str] = []

    def fake_download(repo_id: str, filename: str, cache_dir=None, **_):
        assert repo_id == "org/model"
        requested.append(filename)
        if not (repo / filename).exists():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        target = tmp_path / "cache" / filename
        target.parent.mkdir(exist_ok=True)
        shutil.copy(repo / filename, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    found = load_model_layers(["model.embed_tokens.weight"], "org/model")
    assert torch.equal(found["model.embed_tokens.weight"], TENSORS["model.embed_tokens.weight"])
    assert requested == ["model.safetensors.index.json", "model-00001-of-00003.safetensors"]


def test_bad_config_json_is_a_json_decode_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError, match="config.json"):
        load_checkpoint_config(tmp_path)


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(ValueError, match="is not a readable PyTorch checkpoint"):
        read_checkpoint_tensors(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        read_checkpoint_tensors(tmp_path)


def test_tensor_names_come_from_the_index_or_the_header_of_every_format(tmp_path: Path) -> None:
    from speculators_vllm016.utils.loading import checkpoint_tensor_names

    expected = sorted(TENSORS)
    assert checkpoint_tensor_names(sharded_folder(tmp_path / "sharded")) == expected
    single = tmp_path / "single"
    single.mkdir()
    save_file(TENSORS, str(single / "model.safetensors"))
    assert checkpoint_tensor_names(single) == expected
    pickled = tmp_path / "bin"
    pickled.mkdir()
    torch.save(TENSORS, pickled / "pytorch_model.bin")
    assert checkpoint_tensor_names(pickled) == expected
    with pytest.raises(FileNotFoundError, match="no weights"):
        checkpoint_tensor_names(tmp_path)
