"""The verifier tensors a draft copies, found in every layout vLLM 0.16 serves (Kimi-K2.5's wrapper,
its NVFP4 names, the INT4 release) and refused in one line when one of them is stored quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_vllm016.utils.loading import CheckpointListing
from speculators_vllm016.utils.verifier_weights import (
    QuantizedVerifierWeight,
    fingerprint_of,
    locate_verifier_weights,
    read_verifier_weights,
    verifier_fingerprint,
)
from tests.kimi_variants import int4_variant, without_inner_model


def _same_tensors(found, reference) -> None:
    assert torch.equal(found.embeddings, reference.embeddings)
    assert torch.equal(found.head, reference.head)
    assert torch.equal(found.norm, reference.norm)
    assert not torch.equal(found.head, found.embeddings)  # the real head, not the tied fallback


@pytest.fixture(scope="module")
def reference(tiny_deepseek_v3):
    return read_verifier_weights(str(tiny_deepseek_v3))


def test_the_wrappers_tensors_are_the_language_models(tiny_kimi_k25, tmp_path, reference):
    assert locate_verifier_weights(str(tiny_kimi_k25)).head == "language_model.lm_head.weight"
    _same_tensors(read_verifier_weights(str(tiny_kimi_k25)), reference)
    nvfp4_names = without_inner_model(tiny_kimi_k25, tmp_path / "nvfp4")
    assert (
        locate_verifier_weights(str(nvfp4_names)).embeddings == "language_model.embed_tokens.weight"
    )
    _same_tensors(read_verifier_weights(str(nvfp4_names)), reference)


def test_the_int4_release_is_read_as_stored_when_its_copied_tensors_are_unquantized(
    tiny_kimi_k25, tmp_path, reference
):
    folder = int4_variant(tiny_kimi_k25, tmp_path / "int4")
    _same_tensors(read_verifier_weights(str(folder)), reference)


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ({"pack_lm_head": True}, "stored as weight_packed, weight_scale, weight_shape"),
        ({"ignore_lm_head": False}, "quantization_config quantizes it"),
    ],
)
def test_a_quantized_lm_head_is_refused_in_one_line(tiny_kimi_k25, tmp_path, variant, why):
    folder = int4_variant(tiny_kimi_k25, tmp_path / "int4", **variant)
    for read in (locate_verifier_weights, read_verifier_weights):
        with pytest.raises(QuantizedVerifierWeight) as refused:
            read(str(folder))
        message = str(refused.value)
        assert "\n" not in message
        assert "LM head language_model.lm_head" in message and why in message, message


def test_full_precision_is_checked_on_the_tensors_read(tiny_deepseek_v3, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "fp8"
    shutil.copytree(tiny_deepseek_v3, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizedVerifierWeight, match="LM head lm_head .*float8_e4m3fn"):
        read_verifier_weights(str(folder))


def _tied_variant(model: Path, folder: Path) -> Path:
    """`model` with its LM head removed and tied to the embeddings."""
    shutil.copytree(model, folder)
    for file in folder.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(file).items() if k != "lm_head.weight"}
        save_file(tensors, file, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        content = json.loads(index.read_text())
        content["weight_map"].pop("lm_head.weight", None)
        index.write_text(json.dumps(content))
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_kimi_k25", "tied"])
def test_the_fingerprint_reads_only_the_norm_and_the_head(name, request, tmp_path, monkeypatch):
    """Same value as hashing everything `read_verifier_weights` reads (folders recorded before
    keep matching), without reading the embeddings unless the head is tied to them."""
    if name == "tied":
        path = _tied_variant(request.getfixturevalue("tiny_llama"), tmp_path / "tied")
    else:
        path = request.getfixturevalue(name)
    expected = fingerprint_of(read_verifier_weights(str(path)))
    located = locate_verifier_weights(str(path))
    asked: list[str] = []
    real = CheckpointListing.read

    def spy(listing, names):
        asked.extend(names)
        return real(listing, names)

    monkeypatch.setattr(CheckpointListing, "read", spy)
    assert verifier_fingerprint(str(path)) == expected
    assert (located.embeddings in asked) == (name == "tied")
