"""Variants of the tiny Kimi-K2.5 folder, each the shape of a real release or a real hazard.

- `with_remote_code`: the `auto_map` of the real folder, pointing at a configuration file that
  leaves a marker file when anything imports it (so a test sees whether the folder's code ran).
- `int4_variant`: the INT4 release's layout, written by hand (no quantizer): a compressed-tensors
  `quantization_config` in `text_config`, the routed experts stored as `weight_packed`,
  `weight_scale`, `weight_shape`; optionally the LM head too, or only the config claiming it.
- `without_inner_model`: an NVFP4 release's names, `language_model.layers.N.` (no inner `model.`).
- `with_vision_tower`: a vision tensor beside the language model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

__all__ = [
    "REMOTE_CODE_MARKER",
    "int4_variant",
    "with_remote_code",
    "with_vision_tower",
    "without_inner_model",
]

REMOTE_CODE_MARKER = "remote_code_ran"
INT4_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|down)_proj.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
]


def _copy(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("language_model_source"))
    return dest


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def _rewrite_weights(folder: Path, rewrite) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = rewrite(load_file(str(path)))
    save_file(tensors, str(path), metadata={"format": "pt"})


def with_remote_code(source: Path, dest: Path, model_type: str | None = None) -> Path:
    """The folder with the real release's `auto_map` and a configuration file that, if run,
    writes `REMOTE_CODE_MARKER` into the folder (transformers runs a copy in its module cache);
    `model_type` replaces the top-level one (a type neither library knows needs the code)."""
    out = _copy(source, dest)
    (out / "configuration_kimi_k25.py").write_text(
        "from pathlib import Path\n"
        f"(Path({str(out)!r}) / {REMOTE_CODE_MARKER!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class KimiK25Config(PretrainedConfig):\n"
        f"    model_type = {model_type or 'kimi_k25'!r}\n"
    )

    def edit(config: dict) -> None:
        config["auto_map"] = {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        }
        if model_type is not None:
            config["model_type"] = model_type

    _edit_config(out, edit)
    return out


def _pack(tensors: dict[str, torch.Tensor], name: str) -> None:
    """Replace `<module>.weight` by compressed-tensors' INT4 pack-quantized tensors (values made up)."""
    weight = tensors.pop(name)
    module = name.removesuffix(".weight")
    rows, cols = weight.shape
    tensors[f"{module}.weight_packed"] = torch.zeros(rows, cols // 8, dtype=torch.int32)
    tensors[f"{module}.weight_scale"] = torch.ones(rows, cols // 32, dtype=torch.bfloat16)
    tensors[f"{module}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)


def int4_variant(
    source: Path, dest: Path, *, pack_lm_head: bool = False, ignore_lm_head: bool = True
) -> Path:
    """The INT4 release's layout: routed experts packed; the LM head packed too with
    `pack_lm_head`; `ignore_lm_head=False` leaves it out of the ignore list (the config then
    claims it is quantized, whatever the tensors say)."""
    out = _copy(source, dest)

    def rewrite(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in [n for n in tensors if ".mlp.experts." in n and n.endswith("_proj.weight")]:
            _pack(tensors, name)
        if pack_lm_head:
            _pack(tensors, "language_model.lm_head.weight")
        return tensors

    _rewrite_weights(out, rewrite)

    def edit(config: dict) -> None:
        config["text_config"]["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": [e for e in INT4_IGNORE if ignore_lm_head or e != "lm_head"],
            "kv_cache_scheme": None,
        }

    _edit_config(out, edit)
    return out


def without_inner_model(source: Path, dest: Path) -> Path:
    """`language_model.model.X` stored as `language_model.X` (an NVFP4 release's names)."""
    out = _copy(source, dest)
    _rewrite_weights(
        out,
        lambda tensors: {
            name.replace("language_model.model.", "language_model.", 1): tensor
            for name, tensor in tensors.items()
        },
    )
    return out


def with_vision_tower(source: Path, dest: Path) -> Path:
    """A vision-tower tensor beside the language model (the real folder has a whole tower)."""
    out = _copy(source, dest)

    def rewrite(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors["vision_tower.patch_embed.proj.weight"] = torch.ones(64, 3, 14, 14)
        tensors["mm_projector.proj.0.weight"] = torch.ones(256, 256)
        return tensors

    _rewrite_weights(out, rewrite)
    return out
