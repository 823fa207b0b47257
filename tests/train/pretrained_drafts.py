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


def _llama_fields(ours: Path) -> dict:
    layer = json.loads((ours / "config.json").read_text())["transformer_layer_config"]
    keys = (
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
    return {"model_type": "llama", "num_hidden_layers": 1, **{key: layer[key] for key in keys}}


def _as_midlayer(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        ("midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name): tensor
        for name, tensor in weights.items()
    }


def write_torchspec_draft(ours: Path, out: Path, post_layer_ids: list[int] | None) -> Path:
    """TorchSpec's Llama-layer export (`tools/convert_to_hf.py`, native keys): `midlayer.*`,
    `embed_tokens`, `fc`, `norm`, `lm_head`, `d2t`/`t2d`; config.json a Llama config with
    `draft_vocab_size` and `_torchspec_version`, and (when given) fused layers in TorchSpec's own
    numbering (output of layer i) under `eagle_config`."""
    out.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(ours),
        "draft_vocab_size": 64,
        "torch_dtype": "bfloat16",
        "_torchspec_version": "0.1.0",
    }
    if post_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": post_layer_ids}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = _as_midlayer(_perturbed(load_file(ours / SERVED_FILE), seed=11))
    save_file(weights, str(out / SERVED_FILE), metadata={"torchspec_version": "0.1.0"})
    return out


def write_modelopt_draft(ours: Path, out: Path, post_layer_ids: list[int]) -> Path:
    """Model Optimizer's EAGLE-3 export (`hf_spec_export.py`): `midlayer.*` (its
    `hidden_norm` and `input_layernorm` included), `norm`, `fc`, `lm_head`, `d2t`; no `t2d`, no
    embeddings; config.json with `draft_vocab_size` and its `eagle_config` keys."""
    out.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(ours),
        "draft_vocab_size": 64,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": post_layer_ids,
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": False,
            "use_mtp_layernorm": False,
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = _as_midlayer(_perturbed(load_file(ours / SERVED_FILE), seed=13))
    for dropped in ("embed_tokens.weight", "t2d"):
        weights.pop(dropped)
    save_file(weights, str(out / SERVED_FILE), metadata={"format": "pt"})
    return out


def write_speculators07_draft(ours: Path, out: Path) -> Path:
    """Upstream speculators 0.7's EAGLE-3 draft with its defaults for eagle3 (`norm_before_fc`,
    `norm_output` and `norm_before_residual` on): the speculators format with 0.7's keys, `input_norm.weight` beside
    the layer's weights."""
    out.mkdir(parents=True)
    ours_config = json.loads((ours / "config.json").read_text())
    config = {
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": ours_config["draft_vocab_size"],
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": True,
        "norm_before_residual": True,
        "norm_output": True,
        "speculators_config": ours_config["speculators_config"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.7.0",
        "target_hidden_size": None,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": ours_config["transformer_layer_config"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = _perturbed(load_file(ours / SERVED_FILE), seed=17)
    width = weights["fc.weight"].shape[1]
    generator = torch.Generator().manual_seed(17)
    weights["input_norm.weight"] = (1 + 0.1 * torch.randn(width, generator=generator)).to(
        weights["fc.weight"].dtype
    )
    save_file(weights, str(out / SERVED_FILE), metadata={"format": "pt"})
    return out
