"""The MLA draft on vLLM 0.16 through the plugin (#47 item 2), without an engine: vLLM's own
config path accepts `--draft-arch mla` checkpoints for the tiny DeepSeek-V3 and the Kimi-K2.5
wrapper (`kimi_k2` included) and builds the plugin's draft class; its `load_weights` writes every
parameter from our checkpoint; and the pieces of its forward, run by vLLM's own layers on our
weights, equal our draft's: `fc`, the norms, the MLP, queries and latent keys, vLLM's rotary
embedding (interleaved, YaRN) against ours, the softmax scale, and the logits placed by `d2t`.

What is not here: the attention kernel over vLLM's KV cache and the decode loop (vLLM's CPU build
cannot speculate without the CPU speculation of the `served` work; see docs/kimi-k2.5.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.train.jobs.draft_build import build_draft_config
from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution
from speculators_vllm016.utils.layer_ids import datagen_to_vllm_layer_ids
from tests.vllm_compat.harness import ensure_vllm_distributed, iter_checkpoint_tensors

YARN_4 = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _with_rope(target: Path, folder: Path, rope_scaling: dict) -> Path:
    """A copy of the target with other RoPE scaling (the draft copies its embeddings and head)."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((target / "config.json").read_text())
    config["rope_scaling"] = rope_scaling
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_mla_draft(folder: Path, target: Path) -> Eagle3DraftModel:
    """An MLA draft from our trainer's config writer, weights seeded (not trained)."""
    from transformers import DeepseekV3Config

    config = json.loads((target / "config.json").read_text())
    text = DeepseekV3Config(**config.get("text_config", config))
    draft_config = build_draft_config(
        str(target),
        SimpleNamespace(architectures=config["architectures"], model_type=config["model_type"]),
        text,
        draft_vocab=128,
        num_layers=1,
        norm_before_residual=False,
        ttt_steps=3,
        aux_layer_ids=datagen_to_vllm_layer_ids([0, 1]),
        draft_arch="mla",
    )
    d2t, t2d = build_vocab_mappings_from_distribution(
        {token: 1000 - token for token in range(0, 512, 3)}, 128, 512
    )
    torch.manual_seed(0)
    draft = Eagle3DraftModel(draft_config, t2d=t2d, d2t=d2t)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.normal_(0.0, 0.1)
    draft.save_pretrained(folder)
    return draft


def _vllm_config(draft: Path, target: Path):
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs(
        model=str(target),
        speculative_config={"model": str(draft), "method": "eagle3", "num_speculative_tokens": 3},
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
    )
    return engine_args.create_engine_config()


@pytest.fixture(scope="module")
def mla_disabled():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_MLA_DISABLE", "1")  # the CPU build has no MLA kernels
        yield


@pytest.mark.parametrize(
    ("target", "model_type"), [("tiny_deepseek_v3", "deepseek_v3"), ("tiny_kimi_k25", "kimi_k2")]
)
def test_vllm_accepts_the_mla_draft_and_builds_the_plugins_class(
    target, model_type, request, tmp_path, mla_disabled
):
    from vllm.model_executor.models import ModelRegistry

    folder = request.getfixturevalue(target)
    write_mla_draft(tmp_path / "draft", folder)
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["model_type"] == model_type
    vllm_config = _vllm_config(tmp_path / "draft", folder)
    draft_config = vllm_config.speculative_config.draft_model_config
    assert draft_config.architectures == ["Eagle3DeepseekV2ForCausalLM"]
    assert list(draft_config.hf_config.eagle_aux_hidden_state_layer_ids) == [1, 2]
    assert not draft_config.use_mla  # VLLM_MLA_DISABLE: the plain-attention path
    cls, _ = ModelRegistry.resolve_model_cls(draft_config.architectures, draft_config)
    assert cls.__name__ == "MLAEagle3DraftForCausalLM"


@pytest.fixture(scope="module")
def served(tiny_deepseek_v3, tmp_path_factory, mla_disabled):
    """vLLM's draft model built as its loader builds it, loaded from our checkpoint (YaRN x4)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    root = tmp_path_factory.mktemp("mla_served")
    target = _with_rope(tiny_deepseek_v3, root / "target", YARN_4)
    ours = write_mla_draft(root / "draft", target).eval()
    vllm_config = _vllm_config(root / "draft", target)
    draft_model_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        ensure_vllm_distributed()
        with set_default_torch_dtype(torch.float32), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config, model_config=draft_model_config)
        for parameter in model.parameters():
            parameter.data.fill_(float("nan") if parameter.is_floating_point() else -7)
        loaded = model.load_weights(iter_checkpoint_tensors(root / "draft"))
        # As vLLM's loader does next (the CPU build's linear layers get their kernels here).
        process_weights_after_loading(model, draft_model_config, torch.device("cpu"))
    return SimpleNamespace(model=model, ours=ours, loaded=loaded)


def test_every_parameter_is_loaded_from_our_checkpoint(served):
    model = served.model
    names = {name for name, _ in model.named_parameters()}
    assert served.loaded == names
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point():
            assert not torch.isnan(parameter).any(), name
    assert torch.equal(model.draft_id_to_target_id.data, served.ours.d2t)
    assert model.has_own_embed_tokens and model.has_own_lm_head


def test_vllms_layers_on_our_weights_compute_what_our_draft_does(served):
    from speculators_vllm016.models.eagle3.mla_layer import mla_softmax_scale
    from speculators_vllm016.models.eagle3.model_definitions import _rotary

    model, ours = served.model, served.ours
    ours_layer, layer = ours.layers[0], model.model.layers[0]
    generator = torch.Generator().manual_seed(0)
    hidden = ours.hidden_size
    aux = torch.randn(5, 3 * hidden, generator=generator)
    h = torch.randn(5, hidden, generator=generator)
    e = torch.randn(5, hidden, generator=generator)
    close = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.combine_hidden_states(aux), ours.fc(aux), **close)
        torch.testing.assert_close(layer.hidden_norm(h), ours_layer.hidden_norm(h), **close)
        torch.testing.assert_close(layer.input_layernorm(e), ours_layer.input_layernorm(e), **close)
        torch.testing.assert_close(layer.mlp(h), ours_layer.mlp(h), **close)
        normed, prenorm = model.model.norm(h, e)
        torch.testing.assert_close(prenorm, h + e, **close)
        torch.testing.assert_close(normed, ours.norm(h + e), **close)

        # Queries and the latent/rotary key from [embeds ; hidden], then vLLM's rotary embedding
        # (interleaved pairs, DeepSeek YaRN) against ours at positions past the original length.
        attention, ours_attention = layer.self_attn, ours_layer.self_attn
        x = torch.cat([ours_layer.input_layernorm(e), ours_layer.hidden_norm(h)], dim=-1)
        heads, nope, rope = (
            attention.num_local_heads,
            attention.qk_nope_head_dim,
            attention.qk_rope_head_dim,
        )
        q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(x)[0]))[0]
        latent = attention.kv_a_proj_with_mqa(x)[0]
        positions = torch.tensor([0, 7, 300, 511, 900])
        q_pe, k_pe = q.view(5, heads, -1)[..., nope:].clone(), latent[:, None, -rope:].clone()
        q_pe, k_pe = attention.rotary_emb(positions, q_pe, k_pe)
        vllm_scores = (q_pe * k_pe).sum(-1)

        cos, sin = ours.rotary_emb(x, positions[None])
        from speculators_vllm016.models.eagle3.mla_layer import _pairs_to_halves

        ours_q = ours_attention.q_b_proj(ours_attention.q_a_layernorm(ours_attention.q_a_proj(x)))
        ours_latent = ours_attention.kv_a_proj_with_mqa(x)
        torch.testing.assert_close(q, ours_q, **close)
        torch.testing.assert_close(latent, ours_latent, **close)
        our_q_pe, our_k_pe = _rotary(
            _pairs_to_halves(ours_q.view(1, 5, heads, -1)[..., nope:]),
            _pairs_to_halves(ours_latent[None, :, None, -rope:]),
            cos,
            sin,
        )
        torch.testing.assert_close((our_q_pe * our_k_pe).sum(-1)[0], vllm_scores, **close)
        assert attention.scaling == pytest.approx(
            mla_softmax_scale(ours.config.transformer_layer_config)
        )
        assert attention.scaling != pytest.approx((nope + rope) ** -0.5)  # YaRN x4 changes it

        logits = model.compute_logits(h)
        ours_logits = ours.lm_head(h)
        placed = torch.arange(128) + ours.d2t
        torch.testing.assert_close(logits[:, placed], ours_logits, **close)
        rest = torch.ones(512, dtype=torch.bool)
        rest[placed] = False
        assert torch.isinf(logits[:, rest]).all()


def test_vllms_draft_layer_composes_as_ours(served, monkeypatch):
    """vLLM's draft layer (norms, the `[embeds ; hidden]` order, residual, fused add-norm, MLP)
    around an attention that is ours on the input vLLM hands it: the layer's pre-norm output
    equals our layer's. (vLLM's attention kernel needs the engine's metadata; its projections
    and rotary embedding are compared in the test above.)"""
    model, ours = served.model, served.ours
    layer, ours_layer = model.model.layers[0], ours.layers[0]
    attention = ours_layer.self_attn
    generator = torch.Generator().manual_seed(1)
    h, e = torch.randn(2, 6, ours.hidden_size, generator=generator)
    positions = torch.arange(6)
    cos, sin = ours.rotary_emb(h[None], positions[None])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]

    def our_attention(positions, hidden_states, llama_4_scaling=None):
        query, key, value = attention.project(hidden_states[None], cos, sin)
        return attention.o_proj(attention.attend(query, key, value, causal))[0]

    monkeypatch.setattr(layer.self_attn, "forward", our_attention)
    with torch.no_grad():
        mlp_out, residual = layer(positions, e, h)
        expected = ours_layer(
            h[None], attention_mask=causal, position_embeddings=(cos, sin), input_embeds=e[None]
        )[0]
    torch.testing.assert_close(mlp_out + residual, expected, rtol=1e-5, atol=1e-5)
