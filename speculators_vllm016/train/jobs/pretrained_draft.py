"""The draft a fine-tune starts from (`speculators train --from-pretrained DRAFT`).

A draft comes as a local folder or a hub id (downloaded with `huggingface_hub.snapshot_download`)
in one of two layouts:
- "speculators": a config.json with `speculators_model_type` "eagle3" beside model.safetensors,
  as this package and speculators 0.3.0 write it (`<save-path>/<epoch>/`). The served weights
  (model.safetensors) are read, not a checkpoint's fp32 master copy: what the user names is the
  draft as vLLM serves it, and resuming a run of our own is what `--save-path` is for;
- "research": EAGLE-3 / SpecForge checkpoints, turned into the same config and weights in
  memory by the converter (`speculators convert`'s); the train layer cannot import it, so the
  caller hands it in as a `ResearchReader`.

The draft's config gives the fine-tune's layer shape; the run gives the verifier, the fused
layers and the proposal length (`fine_tune_config`). Whether the draft fits the run is
`train.jobs.draft_match`'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.utils.errors import first_line

if TYPE_CHECKING:
    import torch

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators_vllm016.train.vocab_maps import VocabMaps

__all__ = [
    "PretrainedDraft",
    "ResearchReader",
    "check_draft_weights",
    "draft_vocab_maps",
    "fine_tune_config",
    "load_draft_weights",
    "locate_draft",
    "read_pretrained_draft",
]

# What a hub download fetches: the configs and the weights, nothing else of the repo.
DRAFT_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.bin"]
# Tensors a draft file may hold that the fine-tune takes from the verifier instead.
VERIFIER_COPIES = ("verifier_norm.weight", "verifier_lm_head.weight")

ResearchReader = Callable[
    [Path, str, bool], "tuple[Eagle3SpeculatorConfig, dict[str, torch.Tensor]]"
]
"""(folder, verifier, norm_before_residual) -> the converted config and weights."""


@dataclass
class PretrainedDraft:
    """A draft read whole, before anything of the run is written."""

    source: str
    """As the user named it (folder or hub id)."""
    folder: Path
    """Where its files are (the hub's snapshot folder for a hub id)."""
    layout: str
    """"speculators" (this package's or 0.3.0's), "mla" (the flat MLA layout of vLLM >= 0.18
    and TorchSpec, `mla_layout`) or "research" (converted)."""
    config: Eagle3SpeculatorConfig
    weights: dict[str, torch.Tensor]
    """Its tensors under `Eagle3DraftModel`'s names, in their stored dtype."""

    @property
    def records_norm_before_residual(self) -> bool:
        """Research checkpoints do not say; the run's flag gave the converter its value. An MLA
        draft's flat config says, or means False (vLLM's and TorchSpec's MLA layer)."""
        return self.layout in ("speculators", "mla")


def locate_draft(name: str) -> Path:
    """A local folder as is; anything else is a hub id, downloaded (configs and weights only)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise TrainSetupError(f"--from-pretrained {name} is a file; give the draft's folder")
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=DRAFT_DOWNLOAD_PATTERNS))
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, bad id: one line each
        raise TrainSetupError(
            f"--from-pretrained {name} is no local folder and cannot be downloaded from the hub "
            f"({type(error).__name__}: {first_line(error)}); give the draft's folder"
        ) from None


def _read_config(folder: Path, source: str) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise TrainSetupError(
            f"--from-pretrained {source} has no config.json; is it a draft's folder?"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TrainSetupError(f"cannot read {path} ({first_line(error)})") from None
    if not isinstance(config, dict):
        raise TrainSetupError(f"{path} does not hold a JSON object")
    return config


def read_pretrained_draft(
    name: str,
    verifier: str,
    *,
    norm_before_residual: bool,
    research_reader: ResearchReader | None = None,
) -> PretrainedDraft:
    """The draft `name` in either layout; `norm_before_residual` is used only for a research
    checkpoint (which does not record it)."""
    from speculators_vllm016.models.eagle3.mla_layout import is_flat_mla_config
    from speculators_vllm016.utils.loading import read_checkpoint_tensors

    folder = locate_draft(name)
    raw = _read_config(folder, name)
    kind = raw.get("speculators_model_type")
    if kind is None and is_flat_mla_config(raw):
        return _read_mla_draft(name, folder, raw)
    if kind is None:
        if research_reader is None:
            raise TrainSetupError(
                f"--from-pretrained {name} is a research checkpoint (no speculators_model_type); "
                "`speculators train` converts it, or convert it first with `speculators convert`"
            )
        try:
            config, weights = research_reader(folder, verifier, norm_before_residual)
        except (ValueError, OSError) as error:
            raise TrainSetupError(f"--from-pretrained {name}: {first_line(error)}") from None
        return PretrainedDraft(name, folder, "research", config, weights)
    if kind != "eagle3":
        raise TrainSetupError(
            f"--from-pretrained {name} is an {kind!r} draft; only EAGLE-3 drafts are trained here"
        )
    from speculators_vllm016.models.eagle3 import Eagle3SpeculatorConfig

    try:
        config = Eagle3SpeculatorConfig.from_dict(raw)
        weights = read_checkpoint_tensors(folder)
    except (ValueError, OSError) as error:
        raise TrainSetupError(f"--from-pretrained {name}: {first_line(error)}") from None
    return PretrainedDraft(name, folder, "speculators", config, weights)


def _read_mla_draft(name: str, folder: Path, raw: dict[str, Any]) -> PretrainedDraft:
    """An MLA draft in the flat layout vLLM >= 0.18 and TorchSpec write (`mla_layout`):
    TorchSpec's `midlayer.` names read as `layers.0.`, and the identity vocabulary maps of a
    full-vocabulary draft that left them out."""
    import re

    import torch

    from speculators_vllm016.models.eagle3 import Eagle3SpeculatorConfig
    from speculators_vllm016.models.eagle3.mla_layout import (
        MLA_KEY_MAPPING,
        speculators_dict_from_flat_mla,
    )
    from speculators_vllm016.utils.loading import read_checkpoint_tensors

    try:
        config = Eagle3SpeculatorConfig.from_dict(speculators_dict_from_flat_mla(raw))
        stored = read_checkpoint_tensors(folder)
    except (ValueError, OSError) as error:
        raise TrainSetupError(f"--from-pretrained {name}: {first_line(error)}") from None
    weights = {}
    for key, tensor in stored.items():
        for pattern, replacement in MLA_KEY_MAPPING.items():
            key = re.sub(pattern, replacement, key)
        weights[key] = tensor
    vocab = int(config.transformer_layer_config.vocab_size)
    if config.draft_vocab_size == vocab and "d2t" not in weights and "t2d" not in weights:
        weights["d2t"] = torch.zeros(vocab, dtype=torch.long)
        weights["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return PretrainedDraft(name, folder, "mla", config, weights)


def draft_vocab_maps(draft: PretrainedDraft) -> VocabMaps:
    """The draft's own d2t/t2d, saved beside the run's checkpoints like built maps (so that a
    resumed run and vLLM find them there)."""
    from speculators_vllm016.train.vocab_maps import VocabMaps

    missing = [name for name in ("d2t", "t2d") if name not in draft.weights]
    if missing:
        raise TrainSetupError(
            f"--from-pretrained {draft.source} holds no {'/'.join(missing)}; give the maps it was "
            "trained with (--d2t-path/--t2d-path)"
        )
    return VocabMaps(
        d2t=draft.weights["d2t"].long(),
        t2d=draft.weights["t2d"].bool(),
        built_from=f"the draft {draft.source}",
    )


def fine_tune_config(
    draft: PretrainedDraft,
    speculators_config: Any,
    aux_layer_ids: list[int] | None,
    sliding_window: int | None = None,
) -> Eagle3SpeculatorConfig:
    """The fine-tune's config: the draft's layer shape and head, the run's verifier, proposal
    length and fused layers (equal to the draft's where it records them: `draft_match`).

    `sliding_window` (the run's --sliding-window) replaces the draft's window, or gives a
    full-attention draft one: a window changes no weight, so the draft's weights fine-tune
    under it, and the saved config says the window trained (what vLLM then serves). None keeps
    the draft's own attention, windowed or not."""
    import copy

    from speculators_vllm016.models.eagle3 import Eagle3SpeculatorConfig
    from speculators_vllm016.models.eagle3.config import SLIDING, sliding_window_of

    source = draft.config
    layer = copy.deepcopy(source.transformer_layer_config)
    if sliding_window is not None:
        own = sliding_window_of(layer)
        if own != sliding_window:
            logging.getLogger("speculators").info(
                "--from-pretrained %s was trained with %s; fine-tuning it with --sliding-window %d",
                draft.source,
                "full attention" if own is None else f"a sliding window of {own}",
                sliding_window,
            )
        layer.layer_types = [SLIDING] * int(layer.num_hidden_layers)
        layer.sliding_window = int(sliding_window)
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=source.draft_vocab_size,
        norm_before_residual=source.norm_before_residual,
        target_hidden_size=source.target_hidden_size or layer.hidden_size,
        eagle_aux_hidden_state_layer_ids=aux_layer_ids,
        speculators_config=speculators_config,
        norm_before_fc=source.norm_before_fc,
        fc_norm=source.fc_norm,
        norm_output=source.norm_output,
    )


def _expected_shapes(config: Eagle3SpeculatorConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a draft of `config` saves, by name (the model built on the meta device)."""
    import torch

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel

    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    ignored = set(Eagle3DraftModel._keys_to_ignore_on_save)
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in ignored}


def check_draft_weights(draft: PretrainedDraft) -> None:
    """The draft's tensors against its own config: every weight there, none unknown, each of
    its shape (a damaged or foreign file is refused before anything is written)."""
    try:
        expected = _expected_shapes(draft.config)
    except ValueError as error:
        raise TrainSetupError(f"--from-pretrained {draft.source}: {first_line(error)}") from None
    held = {
        name: tuple(t.shape) for name, t in draft.weights.items() if name not in VERIFIER_COPIES
    }
    missing = sorted(set(expected) - set(held))
    unknown = sorted(set(held) - set(expected))
    wrong = sorted(name for name in set(held) & set(expected) if held[name] != expected[name])
    problems = [
        f"{label} {names[:4]}"
        for label, names in (
            ("missing", missing),
            ("unknown", unknown),
            ("of another shape than its config says", wrong),
        )
        if names
    ]
    if problems:
        raise TrainSetupError(
            f"--from-pretrained {draft.source}: its weights do not fit its config.json "
            f"({'; '.join(problems)})"
        )


def load_draft_weights(model: Eagle3DraftModel, draft: PretrainedDraft) -> None:
    """Copy every weight of the draft into `model` exactly (each is cast to the parameter's
    dtype: fp32 masters hold bf16 values exactly). The verifier copies stay the verifier's."""
    import torch

    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in draft.weights.items():
            if name not in VERIFIER_COPIES:
                state[name].copy_(tensor)
