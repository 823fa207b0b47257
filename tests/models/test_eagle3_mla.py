"""The MLA draft (`--draft-arch mla`, #47): its attention against transformers' DeepSeek-V3
attention on the same weights, its shape from DeepSeek-V3 and Kimi-K2.5 targets, its checkpoint in
the flat layout vLLM >= 0.18 and TorchSpec read (save -> load -> same tensors; a checkpoint built
from TorchSpec's documented config keys and tensor names loads), and training through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators_vllm016.models.eagle3.mla_layer import Eagle3MLAttention
from speculators_vllm016.models.eagle3.mla_layout import (
    MLA_ARCHITECTURE,
    mla_layer_config,
)
from speculators_vllm016.utils.errors import InvalidInputError

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _target_config(**overrides) -> DeepseekV3Config:
    values = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=100,
        max_position_embeddings=256,
        rope_scaling=dict(YARN),
    )
    values.update(overrides)
    return DeepseekV3Config(**values)


def _randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return module


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_mla_attention_equals_transformers_deepseek_v3(q_lora_rank):
    """Same weights, same inputs: our MLA attention (interleaved rotary on the shared rope key,
    YaRN magnitude on cos/sin and mscale**2 in the softmax scale) gives transformers' output."""
    config = _target_config(q_lora_rank=q_lora_rank)
    config._attn_implementation = "eager"
    reference = _randomized(DeepseekV3Attention(config, layer_idx=0)).eval()
    ours = Eagle3MLAttention(config, input_size=config.hidden_size).eval()
    missing = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    length = 12
    x = torch.randn(1, length, config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3, 3 + length)[None]  # offset positions: the rotary must use them
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    additive = torch.zeros(length, length).masked_fill(~causal, float("-inf"))[None, None]
    expected, _ = reference(x, (cos, sin), additive)
    query, key, value = ours.project(x, cos, sin)
    got = ours.o_proj(ours.attend(query, key, value, causal[None, None]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mla_layer_config_is_shaped_from_deepseek_and_kimi_targets():
    target = _target_config()
    layer = mla_layer_config(target)
    for name in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        assert getattr(layer, name) == getattr(target, name)
    assert layer.num_hidden_layers == 1 and layer.rope_scaling["factor"] == 4.0
    assert layer.exported_model_type == "deepseek_v3"
    kimi = mla_layer_config(target, verifier_model_type="kimi_k25")
    assert kimi.exported_model_type == "kimi_k2"
    with pytest.raises(InvalidInputError, match="--draft-arch llama"):
        from transformers import LlamaConfig

        mla_layer_config(LlamaConfig(hidden_size=64, num_attention_heads=4))
    with pytest.raises(InvalidInputError, match="one decoder layer"):
        mla_layer_config(target, num_layers=2)


def _mla_draft(draft_vocab: int = 100, seed: int = 0) -> Eagle3DraftModel:
    config = Eagle3SpeculatorConfig(
        architectures=[MLA_ARCHITECTURE],
        transformer_layer_config=mla_layer_config(_target_config(), verifier_model_type="kimi_k25"),
        draft_vocab_size=draft_vocab,
        target_hidden_size=64,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
    )
    draft = _randomized(Eagle3DraftModel(config), seed)
    draft.t2d.fill_(True)
    return draft


def test_save_writes_the_vllm_torchspec_layout_and_loads_back(tmp_path):
    draft = _mla_draft()
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [MLA_ARCHITECTURE]
    assert config["model_type"] == "kimi_k2"
    # vLLM reads any config with `speculators_config` as a Llama-layer speculators draft.
    assert "speculators_config" not in config and "speculators_model_type" not in config
    for key, value in {
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "vocab_size": 100,
        "draft_vocab_size": 100,
    }.items():
        assert config[key] == value, key
    assert config["rope_scaling"]["factor"] == 4.0
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_config"]["use_input_layernorm_in_first_layer"] is True
    assert config["eagle_config"]["use_last_layernorm"] is True
    names = set(load_file(tmp_path / "model.safetensors"))
    # The names vLLM's Eagle3DeepseekV2ForCausalLM.load_weights reads (it prefixes `model.`).
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.0.self_attn.q_a_proj.weight",
        "layers.0.self_attn.q_a_layernorm.weight",
        "layers.0.self_attn.q_b_proj.weight",
        "layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "layers.0.self_attn.kv_a_layernorm.weight",
        "layers.0.self_attn.kv_b_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= names
    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert isinstance(loaded, Eagle3DraftModel)
    saved = draft.state_dict()
    for name, tensor in loaded.state_dict().items():
        if not name.startswith("verifier_"):
            assert torch.equal(tensor, saved[name]), name
    assert loaded.config.transformer_layer_config.exported_model_type == "kimi_k2"
    hidden = torch.randn(1, 9, 192, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    first, again = draft(hidden, ids, ttt_steps=3), loaded(hidden, ids, ttt_steps=3)
    assert all(torch.equal(a, b) for a, b in zip(first.draft_tokens, again.draft_tokens))


def test_a_torchspec_checkpoint_from_its_documented_keys_loads(tmp_path):
    """TorchSpec's kimi_k25_eagle3_mla.json keys and its tensor names (`midlayer.`, no vocabulary
    maps for a full-vocabulary draft) load as the same draft."""
    draft = _mla_draft()
    tensors = {
        name.replace("layers.0.", "midlayer."): tensor
        for name, tensor in draft.state_dict().items()
        if name not in ("t2d", "d2t") and not name.startswith("verifier_")
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    target = _target_config()
    config = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": 100,
        "draft_vocab_size": 100,
        "torch_dtype": "float32",
        "rope_theta": target.rope_theta,
        "max_position_embeddings": 256,
        "rope_scaling": dict(YARN),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = SpeculatorModel.from_pretrained(tmp_path)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert not loaded.config.norm_before_residual  # TorchSpec's layer: the residual is raw
    assert bool(loaded.t2d.all()) and not bool(loaded.d2t.any())  # identity maps
    state = loaded.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name.replace("midlayer.", "layers.0.")], tensor), name
    hidden = torch.randn(1, 9, 192, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    first, again = draft(hidden, ids, ttt_steps=2), loaded(hidden, ids, ttt_steps=2)
    assert all(torch.equal(a, b) for a, b in zip(first.draft_tokens, again.draft_tokens))

    config["eagle_config"]["use_mtp_layernorm"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInputError, match="use_mtp_layernorm"):
        SpeculatorModel.from_pretrained(tmp_path)


def test_mla_draft_trains_with_packing_ttt_and_gradients():
    """One packed row of two samples, three TTT steps: a loss, and a gradient in every trained
    weight of the MLA layer (frozen copies stay without)."""
    draft = _mla_draft(draft_vocab=100)
    draft.verifier_lm_head.weight.data.normal_(0, 0.2)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 20, 192, generator=generator)
    ids = torch.randint(0, 100, (1, 20), generator=generator)
    out = draft(
        hidden,
        ids,
        lengths=torch.tensor([12, 8]),
        position_ids=torch.cat([torch.arange(12), torch.arange(8)])[None],
        loss_mask=torch.ones(1, 20, dtype=torch.long),
        verifier_last_hidden_states=torch.randn(1, 20, 64, generator=generator),
        ttt_steps=3,
    )
    out.loss.backward()
    for name, parameter in draft.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert parameter.grad is None, name


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_first_layer_is_vllms_composition(norm_before_residual):
    """The layer as vLLM's MLA EAGLE-3 layer composes it, written out with transformers' MLP:
    attention over `[input_layernorm(e) ; hidden_norm(h)]`, residual `h` (or `hidden_norm(h)`),
    then the dense MLP after `post_attention_layernorm`; the pre-norm sum is the output."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    from speculators_vllm016.models.eagle3.mla_layer import DeepseekEagle3FirstLayer

    config = mla_layer_config(_target_config())
    layer = _randomized(DeepseekEagle3FirstLayer(config, 0, norm_before_residual), 2).eval()
    mlp = DeepseekV3MLP(config)
    mlp.load_state_dict(layer.mlp.state_dict())
    generator = torch.Generator().manual_seed(6)
    embeds, hidden = torch.randn(2, 1, 7, 64, generator=generator)
    positions = torch.arange(7)[None]
    cos, sin = DeepseekV3RotaryEmbedding(config)(hidden, positions)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    got = layer(hidden, attention_mask=causal, position_embeddings=(cos, sin), input_embeds=embeds)

    attention = layer.self_attn
    normed = layer.hidden_norm(hidden)
    x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
    attended = attention.o_proj(attention.attend(*attention.project(x, cos, sin), causal))
    after_attention = (normed if norm_before_residual else hidden) + attended
    expected = after_attention + mlp(layer.post_attention_layernorm(after_attention))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
