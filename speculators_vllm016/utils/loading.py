"""Read a few named tensors from a checkpoint without loading the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_model_layers"]


def _local_folder(model_path: str) -> Path:
    path = Path(model_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def load_model_layers(layer_names: list[str], model_path: str) -> dict[str, torch.Tensor]:
    """The tensors named in `layer_names` that the checkpoint has (missing names are left out).

    Reads only the shards that hold them: safetensors (single or indexed) or PyTorch .bin files.
    """
    folder = _local_folder(model_path)
    wanted = set(layer_names)
    found: dict[str, torch.Tensor] = {}
    index = folder / "model.safetensors.index.json"
    if index.exists() or (folder / "model.safetensors").exists():
        from safetensors import safe_open

        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            shards: dict[str, list[str]] = {}
            for name in wanted & set(weight_map):
                shards.setdefault(weight_map[name], []).append(name)
        else:
            shards = {"model.safetensors": list(wanted)}
        for shard, names in shards.items():
            with safe_open(str(folder / shard), framework="pt") as handle:
                available = set(handle.keys())
                for name in names:
                    if name in available:
                        found[name] = handle.get_tensor(name)
        return found
    bins = sorted(folder.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"no safetensors or .bin weights in {folder}")
    for shard in bins:
        state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
        for name in wanted & set(state):
            found[name] = state[name]
    return found
