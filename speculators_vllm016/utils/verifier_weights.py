"""The verifier tensors an EAGLE-3 draft copies: token embeddings, final norm and LM head.

Verifiers keep them under different names (plain causal LMs, multimodal and other wrappers,
bare language models: `utils.language_model_layout`); `locate_verifier_weights` finds them from
the checkpoint's tensor names alone and refuses, in one line, a checkpoint that stores one of
them quantized (the draft copies them as they are stored); `read_verifier_weights` then reads
(or downloads) only those tensors. The draft checks their shapes and copies them
(`Eagle3DraftModel.load_verifier_weights`).

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

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.language_model_layout import (
    LANGUAGE_MODEL_LAYOUTS,
    find_language_model_layout,
)
from speculators_vllm016.utils.loading import checkpoint_tensor_names, load_model_layers
from speculators_vllm016.utils.quantized_weights import (
    FULL_PRECISION_DTYPES,
    config_quantizes,
    quantization_config_of,
    quantized_storage,
)
from speculators_vllm016.utils.verifier_config import load_verifier_config_dict

__all__ = [
    "VERIFIER_WEIGHT_LAYOUTS",
    "QuantizedVerifierWeight",
    "VerifierWeightNames",
    "VerifierWeights",
    "fingerprint_of",
    "locate_verifier_weights",
    "read_verifier_weights",
    "verifier_fingerprint",
    "verifier_rms_norm_eps",
]

# The three copied tensors in a causal LM's names, with the module class a quantizer targets.
_COPIED = (("model.embed_tokens", "Embedding"), ("model.norm", None), ("lm_head", "Linear"))
_ROLE = {"model.embed_tokens": "token embeddings", "model.norm": "final norm", "lm_head": "LM head"}

# (embeddings, final norm, LM head) as each layout of `LANGUAGE_MODEL_LAYOUTS` stores them.
VERIFIER_WEIGHT_LAYOUTS: tuple[tuple[str, str, str], ...] = tuple(
    tuple(layout.stored_name(f"{module}.weight") for module, _ in _COPIED)  # type: ignore[misc]
    for layout in LANGUAGE_MODEL_LAYOUTS
)


class QuantizedVerifierWeight(InvalidInputError):
    """A tensor the draft copies is stored quantized: it cannot be used as it is stored."""


@dataclass(frozen=True)
class VerifierWeightNames:
    """Where one checkpoint stores the tensors a draft copies."""

    embeddings: str
    norm: str
    head: str
    """The LM head's name; absent from the checkpoint when the verifier ties it to the embeddings."""


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


def _refuse_quantized(path: str, module: str, role: str, why: str) -> QuantizedVerifierWeight:
    return QuantizedVerifierWeight(
        f"the verifier's {role} {module} in {path} is quantized ({why}); the draft copies it as "
        "it is stored and cannot use quantized values: use a checkpoint that keeps the embeddings, "
        "final norm and LM head unquantized (the INT4 Kimi-K2.5 release does)"
    )


def locate_verifier_weights(path: str, config_dict: dict | None = None) -> VerifierWeightNames:
    """The names of the verifier's embeddings, final norm and LM head, from the checkpoint's tensor
    names (no tensor is read). Raises `QuantizedVerifierWeight` when its tensors or its
    compressed-tensors `quantization_config` say one of them is stored quantized."""
    return _locate(path, checkpoint_tensor_names(path), config_dict)


def _locate(path: str, names: list[str], config_dict: dict | None) -> VerifierWeightNames:
    """`locate_verifier_weights` on tensor names already listed."""
    layout = find_language_model_layout(names)
    if layout is None:
        raise InvalidInputError(
            f"{path} has no token embeddings (looked for {[lay[0] for lay in VERIFIER_WEIGHT_LAYOUTS]})"
        )
    if config_dict is None:
        config_dict = load_verifier_config_dict(path)
    quantization = quantization_config_of(config_dict)
    present = set(names)
    for module, module_class in _COPIED:
        stored = layout.stored_name(f"{module}.weight").removesuffix(".weight")
        extra = quantized_storage(stored, present)
        if extra:
            raise _refuse_quantized(path, stored, _ROLE[module], "stored as " + ", ".join(extra))
        if f"{stored}.weight" in present and config_quantizes(quantization, stored, module_class):
            raise _refuse_quantized(
                path,
                stored,
                _ROLE[module],
                "its quantization_config quantizes it and does not ignore it",
            )
    return VerifierWeightNames(*(layout.stored_name(f"{module}.weight") for module, _ in _COPIED))


def _check_full_precision(path: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FULL_PRECISION_DTYPES:
        module = name.removesuffix(".weight")
        role = next((r for m, r in _ROLE.items() if module.endswith(m)), "tensor")
        raise _refuse_quantized(path, module, role, f"stored as {tensor.dtype}")


def read_verifier_weights(path: str) -> VerifierWeights:
    """Embeddings, LM head and final norm of the verifier at `path` (a folder or a hub id)."""
    located = locate_verifier_weights(path)
    weights = load_model_layers([located.embeddings, located.norm, located.head], path)
    for name, tensor in weights.items():
        _check_full_precision(path, name, tensor)
    embeddings = weights[located.embeddings]
    return VerifierWeights(
        embeddings=embeddings,
        head=weights.get(located.head, embeddings),  # tied embeddings
        norm=weights.get(located.norm),
        norm_name=located.norm,
    )


def verifier_rms_norm_eps(path: str) -> float | None:
    """The verifier's `rms_norm_eps`, at the top of its config or in its text config."""
    config_dict = load_verifier_config_dict(path)
    for candidate in (
        config_dict,
        config_dict.get("text_config"),
        config_dict.get("language_config"),
    ):
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
    """The identity of the verifier at `path` (a folder or a hub id): `fingerprint_of` its final
    norm and LM head, found as `read_verifier_weights` finds them (plain, multimodal and
    Kimi-K2.5 layouts). Only those two are read: the embeddings of a large vocabulary are
    gigabytes (Kimi-K2.5: 2.3 GB), read once more when the draft copies them."""
    names = checkpoint_tensor_names(path)  # listed once: a hub checkpoint's index is a download
    located = _locate(path, names, None)
    stored = set(names)
    head_name = located.head if located.head in stored else located.embeddings  # tied
    weights = load_model_layers([located.norm, head_name], path)
    for name, tensor in weights.items():
        _check_full_precision(path, name, tensor)
    head = weights[head_name]
    return fingerprint_of(
        VerifierWeights(
            embeddings=head, head=head, norm=weights.get(located.norm), norm_name=located.norm
        )
    )
