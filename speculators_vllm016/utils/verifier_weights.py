"""The verifier tensors an EAGLE-3 draft copies: token embeddings, final norm and LM head.

Verifiers keep them under different names (plain causal LMs, multimodal and other wrappers,
bare language models); `read_verifier_weights` finds the layout and reads (or downloads) only
those tensors. The draft checks their shapes and copies them (`Eagle3DraftModel.load_verifier_weights`).

`verifier_fingerprint` identifies a verifier by its final norm and LM head (what turns its last
hidden states into the training targets): datagen records it in `data_config.json`, training
compares it with the verifier it is given and records it in the draft, `eval` compares it with
the verifier it runs. Two models of the same shapes but other weights differ there, whatever
their paths. It lives in `utils` so that datagen (below the models) can record it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from speculators_vllm016.utils.loading import load_model_layers
from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

__all__ = [
    "VERIFIER_WEIGHT_LAYOUTS",
    "VerifierWeights",
    "read_verifier_weights",
    "verifier_fingerprint",
    "verifier_rms_norm_eps",
]

# Where verifiers keep (embeddings, final norm, LM head): plain causal LMs, multimodal wrappers
# (Llama-4 / Qwen-VL style), Kimi-K2.5 style wrappers, bare language models.
VERIFIER_WEIGHT_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
    ("model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight"),
    (
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ),
    ("embed_tokens.weight", "norm.weight", "lm_head.weight"),
)


@dataclass
class VerifierWeights:
    """The tensors of one layout of `VERIFIER_WEIGHT_LAYOUTS`, as the checkpoint holds them."""

    embeddings: torch.Tensor
    """`[vocab, hidden]` input embeddings."""
    head: torch.Tensor
    """`[vocab, hidden]` LM head; the embeddings themselves when the verifier ties them."""
    norm: torch.Tensor | None
    """`[hidden]` final norm weight; None when the checkpoint has none under `norm_name`."""
    norm_name: str
    """Where the final norm was looked for (for the error that says it is missing)."""


def read_verifier_weights(path: str) -> VerifierWeights:
    """Embeddings, LM head and final norm of the verifier at `path` (a folder or a hub id)."""
    names = [name for layout in VERIFIER_WEIGHT_LAYOUTS for name in layout]
    weights = load_model_layers(list(dict.fromkeys(names)), path)
    layout = next((lay for lay in VERIFIER_WEIGHT_LAYOUTS if lay[0] in weights), None)
    if layout is None:
        raise ValueError(
            f"{path} has no token embeddings (looked for "
            f"{[lay[0] for lay in VERIFIER_WEIGHT_LAYOUTS]})"
        )
    embed_name, norm_name, head_name = layout
    embeddings = weights[embed_name]
    return VerifierWeights(
        embeddings=embeddings,
        head=weights.get(head_name, embeddings),  # tied embeddings
        norm=weights.get(norm_name),
        norm_name=norm_name,
    )


def verifier_rms_norm_eps(path: str) -> float | None:
    """The verifier's `rms_norm_eps`, at the top of its config or in its text config."""
    config_dict = load_verifier_config_dict(path)
    for candidate in (config_dict, config_dict.get("text_config"), config_dict.get("language_config")):
        if isinstance(candidate, dict) and candidate.get("rms_norm_eps") is not None:
            return float(candidate["rms_norm_eps"])
    return None


def fingerprint_of(weights: VerifierWeights) -> str:
    """sha256 (hex, first 16 digits) of the final norm and the LM head as stored: dtype, shape
    and bytes (a verifier without a final norm hashes its head alone)."""
    digest = hashlib.sha256()
    for name, tensor in (("norm", weights.norm), ("head", weights.head)):
        if tensor is None:
            continue
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()[:16]


def verifier_fingerprint(path: str) -> str:
    """The identity of the verifier at `path` (a folder or a hub id): `fingerprint_of` its
    tensors, found by `read_verifier_weights` (plain, multimodal and Kimi-K2.5 layouts)."""
    return fingerprint_of(read_verifier_weights(path))
