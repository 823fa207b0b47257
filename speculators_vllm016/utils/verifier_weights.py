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

`VerifierInfo` is the verifier as a job reads it: once. A job's set-up asks many questions of its
verifier (where the copied tensors are and whether they are quantized, its fingerprint, its
norm's eps, its embeddings for comparing a `--from-pretrained` draft's); each used to read the
checkpoint again, and for a 1T-parameter target on a network filesystem (or a hub id, whose index
is a download) every pass costs. `VerifierInfo.read(path)` lists the checkpoint once (its index or
safetensors header); its config.json and its tensors are read the first time they are asked for
and kept, each tensor once; the checks are functions of what was read. vLLM's own config classes
(train's `load_verifier_config`) read config.json themselves: they cannot be handed a dict.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.language_model_layout import (
    LANGUAGE_MODEL_LAYOUTS,
    find_language_model_layout,
)
from speculators_vllm016.utils.loading import CheckpointListing, list_checkpoint
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
    "VerifierInfo",
    "VerifierWeightNames",
    "VerifierWeights",
    "check_full_precision",
    "fingerprint_of",
    "locate_in_names",
    "locate_verifier_weights",
    "read_verifier_weights",
    "rms_norm_eps_of",
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
    return VerifierInfo.read(path, config_dict).weight_names()


def locate_in_names(
    path: str, names: list[str], config_dict: Callable[[], dict]
) -> VerifierWeightNames:
    """`locate_verifier_weights` on tensor names already listed; `config_dict` gives the
    verifier's config.json (asked for only once the embeddings are found)."""
    layout = find_language_model_layout(names)
    if layout is None:
        raise InvalidInputError(
            f"{path} has no token embeddings (looked for {[lay[0] for lay in VERIFIER_WEIGHT_LAYOUTS]})"
        )
    quantization = quantization_config_of(config_dict())
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


def check_full_precision(path: str, name: str, tensor: torch.Tensor) -> None:
    """Refuse (one line) a copied tensor stored in a quantized dtype."""
    if tensor.dtype not in FULL_PRECISION_DTYPES:
        module = name.removesuffix(".weight")
        role = next((r for m, r in _ROLE.items() if module.endswith(m)), "tensor")
        raise _refuse_quantized(path, module, role, f"stored as {tensor.dtype}")


def read_verifier_weights(path: str) -> VerifierWeights:
    """Embeddings, LM head and final norm of the verifier at `path` (a folder or a hub id)."""
    return VerifierInfo.read(path).weights()


def rms_norm_eps_of(config_dict: dict) -> float | None:
    """`rms_norm_eps` of a verifier's config.json, at its top or in its text config."""
    for candidate in (
        config_dict,
        config_dict.get("text_config"),
        config_dict.get("language_config"),
    ):
        if isinstance(candidate, dict) and candidate.get("rms_norm_eps") is not None:
            return float(candidate["rms_norm_eps"])
    return None


def verifier_rms_norm_eps(path: str) -> float | None:
    """The verifier's `rms_norm_eps`, at the top of its config or in its text config."""
    return rms_norm_eps_of(load_verifier_config_dict(path))


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
    Kimi-K2.5 layouts). Only those two are read (`VerifierInfo.fingerprint`)."""
    return VerifierInfo.read(path).fingerprint()


@dataclass
class VerifierInfo:
    """One verifier (a folder or a hub id), read once; the checks are functions of it."""

    path: str
    listing: CheckpointListing
    """Its tensors' names and where they are stored (its index or header, read once)."""
    config: Any = field(default=None, repr=False)
    """vLLM's config object of it, where the job built one (`train`); None otherwise."""
    text_config: Any = field(default=None, repr=False)
    """Its language model's config (nested in a multimodal config), with `config`."""
    _config_dict: dict | None = field(default=None, repr=False)
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _fingerprint: str | None = field(default=None, repr=False)

    @classmethod
    def read(cls, path: str, config_dict: dict | None = None) -> VerifierInfo:
        """List the checkpoint at `path` (its index or safetensors header, no tensor data);
        `config_dict`: its config.json when the caller has read it already."""
        return cls(path=str(path), listing=list_checkpoint(path), _config_dict=config_dict)

    @property
    def config_dict(self) -> dict:
        """Its config.json, read the first time it is asked for."""
        if self._config_dict is None:
            self._config_dict = load_verifier_config_dict(self.path)
        return self._config_dict

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return self.listing.names

    def weight_names(self) -> VerifierWeightNames:
        """Where it stores the embeddings, final norm and LM head (raises, in one line, when
        one of them is stored quantized: `utils.verifier_weights.locate_in_names`)."""
        return locate_in_names(self.path, list(self.listing.names), lambda: self.config_dict)

    @property
    def rms_norm_eps(self) -> float | None:
        """Its `rms_norm_eps`, at the top of its config or in its text config."""
        return rms_norm_eps_of(self.config_dict)

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of `names` it holds, each read from the checkpoint once."""
        wanted = [name for name in names if name not in self._tensors]
        if wanted:
            found = self.listing.read(wanted)
            if not found and not any(name in self._tensors for name in names):
                raise InvalidInputError(f"{self.path} holds none of the tensors {sorted(wanted)}")
            for name, tensor in found.items():
                check_full_precision(self.path, name, tensor)
            self._tensors.update(found)
        return {name: self._tensors[name] for name in names if name in self._tensors}

    def fingerprint(self) -> str:
        """`utils.verifier_weights.fingerprint_of` its final norm and LM head (only those two
        are read: the embeddings of a large vocabulary are gigabytes, read when asked for)."""
        if self._fingerprint is None:
            located = self.weight_names()
            head_name = located.head if located.head in self.listing.names else located.embeddings
            found = self._read([located.norm, head_name])
            head = found[head_name]
            self._fingerprint = fingerprint_of(
                VerifierWeights(
                    embeddings=head, head=head, norm=found.get(located.norm), norm_name=located.norm
                )
            )
        return self._fingerprint

    def weights(self) -> VerifierWeights:
        """Its embeddings, LM head (the embeddings when tied) and final norm, as stored."""
        located = self.weight_names()
        found = self._read([located.embeddings, located.norm, located.head])
        embeddings = found[located.embeddings]
        return VerifierWeights(
            embeddings=embeddings,
            head=found.get(located.head, embeddings),
            norm=found.get(located.norm),
            norm_name=located.norm,
        )

    def embeddings(self) -> torch.Tensor | None:
        """Its token embeddings as stored (None when the checkpoint holds none)."""
        name = self.weight_names().embeddings
        return self._read([name]).get(name) if name in self.listing.names else None

    def release_tensors(self) -> None:
        """Forget the tensors read so far (the draft holds its copies; the fingerprint stays)."""
        self._tensors.clear()
