"""EagleSpeculator / EagleSpeculatorConfig: forward shapes, saving and loading, vLLM 0.16 loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from speculators_vllm016.config import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle import EagleSpeculator, EagleSpeculatorConfig
from speculators_vllm016.proposals.greedy import GreedyTokenProposalConfig

H, VOCAB = 256, 512


def layer_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
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
    from speculators_vllm016.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("verifier") / "llama")


@pytest.fixture(scope="module")
def verifier(verifier_path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(verifier_path).eval()


def test_config_defaults_and_roundtrip(tmp_path: Path) -> None:
    config = EagleSpeculatorConfig()
    assert config.speculators_model_type == "eagle"
    assert config.architectures == ["EagleSpeculator"]
    assert config.transformer_layer_architecture == "auto"
    assert isinstance(config.transformer_layer_config, LlamaConfig)
    assert (config.layernorms, config.fusion_bias) == (False, False)
    assert EagleSpeculatorConfig(
        transformer_layer_architecture="LlamaDecoderLayer"
    ).architectures == ["EagleSpeculator", "LlamaDecoderLayer"]

    config = make_config(layernorms=True, fusion_bias=True)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert isinstance(saved["transformer_layer_config"], dict)
    assert saved["transformer_layer_config"]["model_type"] == "llama"
    loaded = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert type(loaded) is EagleSpeculatorConfig
    assert loaded.layernorms and loaded.fusion_bias
    assert loaded.transformer_layer_config.hidden_size == H
    # A dict without model_type is taken for a Llama config.
    as_dict = EagleSpeculatorConfig(transformer_layer_config={"hidden_size": 64})
    assert isinstance(as_dict.transformer_layer_config, LlamaConfig)
    with pytest.raises(ValueError):
        EagleSpeculatorConfig(transformer_layer_config=3)
    with pytest.raises(ValueError, match="model_type"):
        EagleSpeculatorConfig(transformer_layer_config={"model_type": "no-such-model"})


@pytest.mark.parametrize("hass", [False, True], ids=["eagle1", "hass"])
def test_weights_layout(hass: bool) -> None:
    model = EagleSpeculator(make_config(layernorms=hass, fusion_bias=hass))
    names = set(model.state_dict())
    layer = {
        f"transformer.{n}.weight"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    extra = (
        {
            "fusion_fc.bias",
            "embedding_layernorm.weight",
            "transformer.input_layernorm.weight",
            "pre_lm_head_layernorm.weight",
        }
        if hass
        else set()
    )
    assert names == {"fusion_fc.weight"} | layer | extra  # 0.3.0's names
    assert model.config.transformer_layer_architecture == "LlamaDecoderLayer"


@pytest.mark.parametrize("hass", [False, True], ids=["eagle1", "hass"])
def test_forward_shapes(verifier: LlamaForCausalLM, hass: bool) -> None:
    torch.manual_seed(0)
    model = EagleSpeculator(make_config(layernorms=hass, fusion_bias=hass)).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    hidden = torch.randn(2, 7, H)
    with pytest.raises(ValueError, match="attach_verifier"):
        model(ids, hidden)
    model.attach_verifier(verifier)
    assert model.embed_tokens is verifier.model.embed_tokens and model.lm_head is verifier.lm_head
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in model.state_dict())
    with torch.no_grad():
        out = model(ids, hidden)
        assert out.logits.shape == (2, 7, VOCAB)
        assert model(ids, hidden, return_dict=False).shape == (2, 7, VOCAB)
        # Causal: the prefix does not see later positions.
        prefix = model(ids[:, :4], hidden[:, :4]).logits
        assert torch.allclose(prefix, out.logits[:, :4], atol=1e-5)
        # Cached decoding gives the same logits as one full pass.
        first = model(ids[:, :4], hidden[:, :4], use_cache=True)
        rest = model(
            ids[:, 4:], hidden[:, 4:], past_key_values=first.past_key_values, use_cache=True
        )
        assert torch.allclose(rest.logits, out.logits[:, 4:], atol=1e-5)
        # Left padding: masked positions do not change the others.
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, :2] = 0
        masked = model(ids, hidden, attention_mask=mask).logits
        assert torch.allclose(masked[1], out.logits[1], atol=1e-5)
    with pytest.raises(ValueError, match="hidden_states"):
        model(ids, torch.randn(2, 7, H + 1))
    model.detach_verifier()
    assert model.embed_tokens is None and model.lm_head is None


def test_save_load_roundtrip(tmp_path: Path, verifier_path: Path) -> None:
    # The verifier named in the config is attached from its path, as in 0.3.0.
    model = EagleSpeculator(make_config(verifier=str(verifier_path), fusion_bias=True))
    assert model.verifier_attachment_mode == "full" and model.lm_head is not None
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.startswith(("embed_tokens", "lm_head", "verifier")) for k in saved)
    for loader in (EagleSpeculator, SpeculatorModel):
        loaded = loader.from_pretrained(tmp_path)
        assert type(loaded) is EagleSpeculator
        state = loaded.state_dict()
        assert state.keys() == model.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with_verifier = SpeculatorModel.from_pretrained(
        tmp_path, verifier=str(verifier_path), verifier_attachment_mode="full"
    )
    assert with_verifier.lm_head is not None
    detached = SpeculatorModel.from_pretrained(tmp_path, verifier_attachment_mode="detached")
    assert detached.lm_head is None


def test_loads_folders_of_earlier_builds(tmp_path: Path) -> None:
    """Earlier builds of this library saved vLLM's EAGLE-1 names fc / layers.0."""
    model = EagleSpeculator(make_config())
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    earlier = {
        k.replace("fusion_fc.", "fc.", 1).replace("transformer.", "layers.0.", 1): v
        for k, v in load_file(str(path)).items()
    }
    save_file(earlier, str(path), metadata={"format": "pt"})
    loaded = EagleSpeculator.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="EagleSpeculatorConfig"):
        EagleSpeculator(SpeculatorModelConfig(speculators_model_type="eagle"))
    with pytest.raises(ValueError, match="transformer_layer_architecture"):
        EagleSpeculator(make_config(transformer_layer_architecture="NoSuchLayer"))


def test_vllm_eagle1_draft_loads_weights(tmp_path: Path, verifier_path: Path) -> None:
    """vLLM 0.16's EagleLlamaForCausalLM takes every saved weight, and needs no other.

    vLLM 0.16 refuses `speculators_model_type: eagle` (only eagle3 is registered), so the draft
    is given to vLLM the way it reads EAGLE-1 drafts: a plain Llama config.json beside our
    model.safetensors, with method "eagle".
    """
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tests.vllm_compat.harness import ensure_vllm_distributed, shutdown_vllm_distributed

    model = EagleSpeculator(make_config(verifier=str(verifier_path)))
    speculator = tmp_path / "speculator"
    model.save_pretrained(speculator)
    draft = tmp_path / "vllm_draft"
    draft.mkdir()
    layer = json.loads((speculator / "config.json").read_text())["transformer_layer_config"]
    llama = LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})
    llama.architectures = ["LlamaForCausalLM"]
    llama.save_pretrained(draft)
    # Our folder uses 0.3.0's names; vLLM's EAGLE-1 draft reads the research names fc / layers.0.
    research = {
        k.replace("fusion_fc.", "fc.", 1).replace("transformer.", "layers.0.", 1): v
        for k, v in load_file(str(speculator / "model.safetensors")).items()
    }
    save_file(research, str(draft / "model.safetensors"), metadata={"format": "pt"})

    vllm_config = EngineArgs(
        model=str(verifier_path),
        speculative_config={"model": str(draft), "method": "eagle", "num_speculative_tokens": 3},
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
    ).create_engine_config()
    draft_config = vllm_config.speculative_config.draft_model_config
    try:
        with set_current_vllm_config(vllm_config):
            ensure_vllm_distributed()
            with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
                vllm_model = initialize_model(vllm_config=vllm_config, model_config=draft_config)
            assert isinstance(vllm_model, EagleLlamaForCausalLM)
            params = dict(vllm_model.named_parameters())
            for p in params.values():
                p.data.fill_(float("nan"))
            weights = load_file(str(draft / "model.safetensors"))
            with torch.no_grad():
                vllm_model.load_weights(iter(weights.items()))  # KeyError on an unknown name
    finally:
        shutdown_vllm_distributed()
    # Everything but the embedding (shared with the verifier when absent) was written.
    unwritten = {n for n, p in params.items() if torch.isnan(p).any()}
    assert unwritten == {"model.embed_tokens.weight"}
    ours = model.state_dict()
    assert torch.equal(params["model.fc.weight"], ours["fusion_fc.weight"])
    q, k, v = (ours[f"transformer.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
