"""Drafts to fine-tune (`--from-pretrained`), one per layout it reads: ours (a checkpoint our
trainer wrote), speculators 0.3.0's (its files written out in 0.3.0's format) and a
research/SpecForge checkpoint (`midlayer.*` names, no embeddings)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculators_vllm016.cli.train import main
from tests.training_fixtures import finished_checkpoints, train_args

# What `Eagle3DraftModel` saves that a draft of another layout must hold too.
SERVED_FILE = "model.safetensors"


def train_ours(verifier: Path, data: Path, save: Path) -> Path:
    """A draft our trainer wrote: two steps, so it is no longer its initial weights."""
    assert main(train_args(verifier, data, save, "--max-steps", "2", "--epochs", "1")) == 0
    return save / finished_checkpoints(save)[-1]


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Trained weights moved a little (so a loader that read the wrong draft is caught); the
    verifier's embeddings and the vocabulary maps stay as they are."""
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in weights.items():
        if tensor.is_floating_point() and name != "embed_tokens.weight":
            noise = torch.randn(tensor.shape, generator=generator) * 0.01
            tensor = (tensor.float() + noise).to(tensor.dtype)
        moved[name] = tensor
    return moved


def write_030_draft(ours: Path, out: Path) -> Path:
    """The files speculators 0.3.0's trainer writes for an epoch: config.json (no
    eagle_aux_hidden_state_layer_ids: 0.3.0 never wrote it; target_hidden_size left null) and
    model.safetensors in bf16 without the verifier's LM head copy."""
    out.mkdir(parents=True)
    ours_config = json.loads((ours / "config.json").read_text())
    layer = dict(ours_config["transformer_layer_config"])
    layer["torch_dtype"] = layer.pop("dtype", "bfloat16")
    config = {
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": ours_config["draft_vocab_size"],
        "eagle_aux_hidden_state_layer_ids": None,
        "norm_before_residual": True,
        "speculators_config": ours_config["speculators_config"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "target_hidden_size": None,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": layer,
        "transformers_version": "4.56.2",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = _perturbed(load_file(ours / SERVED_FILE), seed=30)
    save_file(weights, str(out / SERVED_FILE), metadata={"format": "pt"})
    return out


def write_research_draft(ours: Path, out: Path) -> Path:
    """An EAGLE-3 research checkpoint (SafeAILab/SpecForge layout): the decoder layer as
    `midlayer.*`, no token embeddings (the converter takes the verifier's), a plain Llama-style
    config.json with `draft_vocab_size`."""
    out.mkdir(parents=True)
    layer = json.loads((ours / "config.json").read_text())["transformer_layer_config"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **{
            key: layer[key]
            for key in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
                "rms_norm_eps",
                "rope_theta",
                "vocab_size",
            )
        },
        "num_hidden_layers": 1,
        "draft_vocab_size": 64,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = _perturbed(load_file(ours / SERVED_FILE), seed=7)
    research = {
        ("midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name): tensor
        for name, tensor in weights.items()
        if name != "embed_tokens.weight"
    }
    save_file(research, str(out / SERVED_FILE), metadata={"format": "pt"})
    return out


def draft_variant(
    ours: Path,
    out: Path,
    *,
    config: Callable[[dict], None] | None = None,
    weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of `ours` with its config.json and/or tensors changed in place by the callables."""
    shutil.copytree(ours, out)
    if config is not None:
        values = json.loads((out / "config.json").read_text())
        config(values)
        (out / "config.json").write_text(json.dumps(values))
    if weights is not None:
        tensors = load_file(out / SERVED_FILE)
        weights(tensors)
        save_file(tensors, str(out / SERVED_FILE))
    return out
