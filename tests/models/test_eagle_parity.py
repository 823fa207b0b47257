"""EagleSpeculator behaves as 0.3.0's: its files, verifier attachment, rotary, config (issue 12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle import EagleSpeculator, EagleSpeculatorConfig
from speculators_vllm016.proposals.greedy import GreedyTokenProposalConfig

H, VOCAB = 64, 128


def layer_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )


def make_config(verifier: str | None = None, **kwargs) -> EagleSpeculatorConfig:
    return EagleSpeculatorConfig(
        transformer_layer_config=layer_config(),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"]),
        ),
        **kwargs,
    )


@pytest.fixture(scope="module")
def verifier_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    )
    path = tmp_path_factory.mktemp("eagle_parity") / "verifier"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture()
def verifier(verifier_path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(verifier_path).eval()


def names_030(hass: bool) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes 0.3.0's EagleSpeculator saves, derived from a plain Llama layer."""
    layer = LlamaDecoderLayer(layer_config(), layer_idx=0)
    shapes = {
        f"transformer.{name}": tuple(t.shape)
        for name, t in layer.state_dict().items()
        if hass or not name.startswith("input_layernorm")
    }
    shapes["fusion_fc.weight"] = (H, 2 * H)
    if hass:
        shapes["fusion_fc.bias"] = (H,)
        shapes["embedding_layernorm.weight"] = (H,)
        shapes["pre_lm_head_layernorm.weight"] = (H,)
    return shapes


def write_030_folder(path: Path, hass: bool, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A folder as 0.3.0 writes it: its config.json keys and its weight names."""
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(1)
    weights = {
        name: torch.randn(shape, generator=generator) for name, shape in names_030(hass).items()
    }
    if drop is not None:
        del weights[drop]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "speculators_version": "0.3.0",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": {**layer_config().to_diff_dict(), "model_type": "llama"},
        "layernorms": hass,
        "fusion_bias": hass,
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
        "transformers_version": "4.56.0",
    }
    (path / "config.json").write_text(json.dumps(config))
    return weights


# ----------------------------------------------------------------- item 4: files both ways


@pytest.mark.parametrize("hass", [False, True], ids=["eagle1", "hass"])
def test_saved_weights_carry_0_3_0_names(tmp_path: Path, hass: bool) -> None:
    model = EagleSpeculator(make_config(layernorms=hass, fusion_bias=hass))
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == names_030(hass)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"][0] == "EagleSpeculator"  # save_pretrained writes the class
    assert config["transformer_layer_architecture"] == "LlamaDecoderLayer"


@pytest.mark.parametrize("hass", [False, True], ids=["eagle1", "hass"])
def test_0_3_0_folder_loads_every_weight_through_either_class(tmp_path: Path, hass: bool) -> None:
    weights = write_030_folder(tmp_path / "v030", hass)
    for loader in (SpeculatorModel, EagleSpeculator):
        model = loader.from_pretrained(tmp_path / "v030")
        assert type(model) is EagleSpeculator
        state = model.state_dict()
        assert state.keys() == weights.keys()
        for name, tensor in weights.items():
            assert torch.equal(state[name], tensor), f"{loader.__name__}: {name} re-initialised"


def test_a_checkpoint_missing_weights_is_refused_not_reinitialised(tmp_path: Path) -> None:
    write_030_folder(tmp_path / "partial", hass=False, drop="transformer.mlp.up_proj.weight")
    for loader in (SpeculatorModel, EagleSpeculator):
        with pytest.raises(ValueError, match=r"transformer\.mlp\.up_proj\.weight"):
            loader.from_pretrained(tmp_path / "partial")
    # Weights under foreign names (here: an EAGLE-3 style layer) are refused the same way.
    weights = write_030_folder(tmp_path / "foreign", hass=False)
    foreign = {k.replace("transformer.", "midlayer."): v for k, v in weights.items()}
    save_file(foreign, str(tmp_path / "foreign" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="randomly initialised"):
        SpeculatorModel.from_pretrained(tmp_path / "foreign")


# Cross-check against the real 0.3.0 package, when a copy of it is at hand (it cannot be a test
# dependency: it is the package this one replaces). Unzip its wheel and point the variable at it:
#   pip download --no-deps speculators==0.3.0 -d /tmp/w && unzip /tmp/w/*.whl -d /tmp/spec030
#   SPECULATORS_030_PATH=/tmp/spec030 pytest tests/models/test_eagle_parity.py
CROSS_CHECK = r"""
import sys, torch
from speculators.models.eagle import EagleSpeculator, EagleSpeculatorConfig
from speculators import SpeculatorModel
assert "speculators_vllm016" not in sys.modules
ours, out = sys.argv[1], sys.argv[2]
model = SpeculatorModel.from_pretrained(ours, verifier_attachment_mode="detached")
assert type(model) is EagleSpeculator, type(model)
torch.save(model.state_dict(), out + ".pt")
model.save_pretrained(out)
"""


@pytest.mark.skipif(not os.environ.get("SPECULATORS_030_PATH"), reason="SPECULATORS_030_PATH unset")
def test_real_0_3_0_loads_ours_and_we_load_its(tmp_path: Path) -> None:
    ours = EagleSpeculator(make_config(fusion_bias=True, layernorms=True))
    ours.save_pretrained(tmp_path / "ours")
    env = {**os.environ, "PYTHONPATH": os.environ["SPECULATORS_030_PATH"]}
    result = subprocess.run(
        [sys.executable, "-c", CROSS_CHECK, str(tmp_path / "ours"), str(tmp_path / "theirs")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs_state = torch.load(tmp_path / "theirs.pt", weights_only=True)
    ours_state = ours.state_dict()
    assert theirs_state.keys() == ours_state.keys()
    assert all(torch.equal(theirs_state[k], v) for k, v in ours_state.items())
    back = SpeculatorModel.from_pretrained(tmp_path / "theirs")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ours_state.items())


# ------------------------------------------------------------- items 5, 6: the verifier


def test_train_only_keeps_embeddings_and_head_but_no_verifier(verifier: LlamaForCausalLM) -> None:
    model = EagleSpeculator(make_config(), verifier=verifier, verifier_attachment_mode="train_only")
    assert model.verifier is None and model.verifier_attachment_mode == "train_only"
    assert model.embed_tokens is verifier.model.embed_tokens
    assert model.lm_head is verifier.lm_head
    assert model.rotary_emb is verifier.model.rotary_emb
    with torch.no_grad():
        logits = model(torch.randint(0, VOCAB, (1, 5)), torch.randn(1, 5, H), return_dict=False)
    assert logits.shape == (1, 5, VOCAB)


def test_one_verifier_at_a_time_and_bad_verifiers(verifier: LlamaForCausalLM) -> None:
    model = EagleSpeculator(make_config())
    assert model.verifier_attachment_mode == "detached" and model.rotary_emb is None
    with pytest.raises(TypeError, match="int"):
        model.attach_verifier(123)
    assert model.verifier_attachment_mode == "detached" and model.embed_tokens is None
    model.attach_verifier(verifier)
    assert model.verifier is verifier and model.verifier_attachment_mode == "full"
    assert model.rotary_emb is verifier.model.rotary_emb
    with pytest.raises(RuntimeError, match="detach_verifier"):
        model.attach_verifier(verifier, mode="train_only")
    model.detach_verifier()
    assert (model.verifier, model.embed_tokens, model.rotary_emb, model.lm_head) == (None,) * 4
    with pytest.raises(RuntimeError):
        model.detach_verifier()
    with pytest.raises(ValueError, match="config"):
        SpeculatorModel(config=None)


def test_verifier_parts_are_child_modules(verifier: LlamaForCausalLM) -> None:
    model = EagleSpeculator(make_config(), verifier=verifier)
    children = dict(model.named_children())
    assert children["verifier"] is verifier
    assert children["embed_tokens"] is verifier.model.embed_tokens
    assert children["lm_head"] is verifier.lm_head
    assert not any(
        k.startswith(("verifier.", "embed_tokens", "lm_head")) for k in model.state_dict()
    )
    model.to(torch.float64)
    assert verifier.model.embed_tokens.weight.dtype == torch.float64
    parameters = {id(p) for p in model.parameters()}
    assert id(verifier.lm_head.weight) in parameters
    replacement = nn.Embedding(VOCAB, H).to(torch.float64)
    model.embed_tokens = replacement  # assignment works, as on any module
    assert dict(model.named_children())["embed_tokens"] is replacement


def test_the_config_names_the_verifier_to_attach(tmp_path: Path, verifier_path: Path) -> None:
    config = make_config(verifier=str(verifier_path))
    model = EagleSpeculator(config)
    assert model.verifier_attachment_mode == "full" and model.lm_head is not None
    assert EagleSpeculator(config, verifier_attachment_mode="detached").lm_head is None
    model.save_pretrained(tmp_path)
    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert loaded.verifier_attachment_mode == "full"
    # Loading did not touch the verifier's weights (they are attached after the load).
    reference = LlamaForCausalLM.from_pretrained(verifier_path)
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(loaded.embed_tokens.weight, reference.model.embed_tokens.weight)
    trained = SpeculatorModel.from_pretrained(tmp_path, verifier_attachment_mode="train_only")
    assert trained.verifier is None and trained.lm_head is not None
    assert (
        SpeculatorModel.from_pretrained(tmp_path, verifier_attachment_mode="detached").lm_head
        is None
    )


# ---------------------------------------------------------- item 7: the caller's config


def test_building_the_model_leaves_the_callers_layer_config_alone() -> None:
    layer = layer_config()
    before = layer.to_dict()
    assert layer._attn_implementation_internal is None
    config = make_config()
    config.transformer_layer_config = layer
    EagleSpeculator(config)
    assert config.transformer_layer_config is layer
    assert layer._attn_implementation_internal is None
    assert layer.to_dict() == before
