"""Converters on tiny research-layout checkpoints built here (EAGLE-1, HASS, EAGLE-3).

Each test writes a checkpoint shaped like the public releases, converts it against a tiny Llama
verifier and checks config.json key by key, the weight names, what vLLM 0.16's speculators
config reader makes of the folder, and that the library reloads it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_vllm016.convert import convert_model
from speculators_vllm016.convert.eagle import EagleConverter
from speculators_vllm016.convert.eagle.eagle3_converter import Eagle3Converter
from speculators_vllm016.convert.eagle.utils import (
    detect_fusion_bias_and_layernorms,
    ensure_checkpoint_is_local,
    find_vocab_size,
    load_checkpoint_config,
    load_checkpoint_weights,
)

H, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 2, 64, 512
DRAFT_VOCAB = 128


def _llama_fields(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        **extra,
    }


def _layer(prefix: str, attn_in: int, *, input_norm: bool, hidden_norm: bool = False) -> dict:
    g = torch.Generator().manual_seed(len(prefix) + attn_in)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    weights = {
        f"{prefix}self_attn.q_proj.weight": r(HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.o_proj.weight": r(H, HEADS * HEAD_DIM),
        f"{prefix}post_attention_layernorm.weight": 1 + r(H),
        f"{prefix}mlp.gate_proj.weight": r(INTER, H),
        f"{prefix}mlp.up_proj.weight": r(INTER, H),
        f"{prefix}mlp.down_proj.weight": r(H, INTER),
    }
    if input_norm:
        weights[f"{prefix}input_layernorm.weight"] = 1 + r(H)
    if hidden_norm:
        weights[f"{prefix}hidden_norm.weight"] = 1 + r(H)
    return weights


def _write(folder: Path, config: dict, weights: dict, as_bin: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if as_bin:
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, str(folder / "model.safetensors"))
    return folder


def eagle1_checkpoint(folder: Path, hass: bool = False) -> tuple[Path, dict]:
    """EAGLE-1 release layout (pytorch_model.bin); HASS adds fc.bias and three norms."""
    weights = {
        "fc.weight": torch.randn(H, 2 * H) * 0.02,
        "embed_tokens.weight": torch.randn(VOCAB, H),
    }
    weights.update(_layer("layers.0.", H, input_norm=False))
    if hass:
        weights["fc.bias"] = torch.randn(H) * 0.02
        weights["embed_layernorm.weight"] = 1 + torch.randn(H) * 0.01
        weights["hidden_layernorm.weight"] = 1 + torch.randn(H) * 0.01
        weights["lm_head_layernorm.weight"] = 1 + torch.randn(H) * 0.01
    return _write(folder, _llama_fields(), weights, as_bin=not hass), weights


def eagle3_checkpoint(folder: Path, reduced_vocab: bool = True) -> tuple[Path, dict]:
    """EAGLE-3 release layout: midlayer.*, fc over 3 hidden states, own head, d2t/t2d."""
    draft_vocab = DRAFT_VOCAB if reduced_vocab else VOCAB
    weights = {
        "fc.weight": torch.randn(H, 3 * H) * 0.02,
        "norm.weight": 1 + torch.randn(H) * 0.01,
        "lm_head.weight": torch.randn(draft_vocab, H) * 0.02,
    }
    weights.update(_layer("midlayer.", 2 * H, input_norm=True, hidden_norm=True))
    if reduced_vocab:
        kept = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        weights["t2d"] = t2d
        weights["d2t"] = kept - torch.arange(DRAFT_VOCAB)
        weights["embed_tokens.weight"] = torch.randn(VOCAB, H)
    config = _llama_fields(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    return _write(folder, config, weights, as_bin=True), weights


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from speculators_vllm016.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("verifier") / "llama")


def _check_speculators_config(config: dict, algorithm: str, verifier: Path) -> None:
    assert config["speculators_config"] == {
        "algorithm": algorithm,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": 3,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
    }
    assert isinstance(config["speculators_version"], str) and config["speculators_version"]
    assert isinstance(config["transformer_layer_config"], dict)
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama"
    assert layer["hidden_size"] == H and layer["num_attention_heads"] == HEADS
    assert layer["num_key_value_heads"] == KV_HEADS and layer["intermediate_size"] == INTER


def _check_modes_as_the_umask_allows(folder: Path) -> None:
    """The weights are as readable as the config beside them (safetensors alone writes 0600)."""
    from speculators_vllm016.utils.atomic_files import usual_file_mode

    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file()}
    assert set(modes.values()) == {usual_file_mode()}, modes


# ---------------------------------------------------------------- EAGLE-1 / HASS


@pytest.mark.parametrize("hass", [False, True], ids=["eagle1", "hass"])
def test_eagle_conversion(tmp_path: Path, verifier: Path, hass: bool) -> None:
    from speculators_vllm016.model import SpeculatorModel
    from speculators_vllm016.models.eagle import EagleSpeculator

    source, research = eagle1_checkpoint(tmp_path / "research", hass=hass)
    out = tmp_path / "out"
    convert_model(str(source), str(verifier), "eagle", output_path=str(out), validate_device="cpu")

    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle"
    assert config["architectures"] == ["EagleSpeculator"]
    assert config["transformer_layer_architecture"] == "LlamaDecoderLayer"
    assert config["layernorms"] is hass and config["fusion_bias"] is hass
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    _check_speculators_config(config, "eagle", verifier)
    _check_modes_as_the_umask_allows(out)

    saved = load_file(str(out / "model.safetensors"))
    expected = {
        k.replace("fc.", "fusion_fc.", 1).replace("layers.0.", "transformer.", 1): v
        for k, v in research.items()
        if k != "embed_tokens.weight"
    }
    if hass:
        for old, new in [
            ("embed_layernorm.weight", "embedding_layernorm.weight"),
            ("hidden_layernorm.weight", "transformer.input_layernorm.weight"),
            ("lm_head_layernorm.weight", "pre_lm_head_layernorm.weight"),
        ]:
            expected[new] = expected.pop(old)
    assert sorted(saved) == sorted(expected)  # 0.3.0 names: fusion_fc.*, transformer.*
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name

    for loader in (EagleSpeculator, SpeculatorModel):
        model = loader.from_pretrained(out)
        assert type(model) is EagleSpeculator
        assert model.config.layernorms is hass
        state = model.state_dict()
        assert sorted(state) == sorted(expected)
        assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_eagle_vllm_speculators_config(tmp_path: Path, verifier: Path) -> None:
    """vLLM 0.16 reads the speculative settings, but its config path only knows 'eagle3'."""
    from vllm.transformers_utils.configs import SpeculatorsConfig
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    source, _ = eagle1_checkpoint(tmp_path / "research")
    out = tmp_path / "out"
    convert_model(str(source), str(verifier), "eagle", output_path=str(out))
    config = json.loads((out / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == {
        "method": "eagle",
        "num_speculative_tokens": 3,
    }
    assert "eagle" not in SUPPORTED_SPECULATORS_TYPES
    with pytest.raises(ValueError, match="Expected one of"):
        SpeculatorsConfig.from_pretrained(str(out))


def test_eagle_variant_detection_and_flags(tmp_path: Path, verifier: Path) -> None:
    source, research = eagle1_checkpoint(tmp_path / "research")
    assert detect_fusion_bias_and_layernorms(research) == (False, False)
    out = tmp_path / "out"
    # Asking for HASS parts the checkpoint lacks gives no-op parts, not random ones.
    EagleConverter().convert(source, out, str(verifier), fusion_bias=True, layernorms=True)
    saved = load_file(str(out / "model.safetensors"))
    assert torch.equal(saved["fusion_fc.bias"], torch.zeros(H))
    assert torch.equal(saved["embedding_layernorm.weight"], torch.ones(H))
    config = json.loads((out / "config.json").read_text())
    assert config["fusion_bias"] is True and config["layernorms"] is True


def test_eagle_malformed_checkpoints(tmp_path: Path, verifier: Path) -> None:
    source, research = eagle1_checkpoint(tmp_path / "bad_key")
    research["midlayer.foo.weight"] = torch.zeros(1)
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="unexpected weights"):
        convert_model(str(source), str(verifier), "eagle", output_path=str(tmp_path / "o1"))

    source, research = eagle1_checkpoint(tmp_path / "missing")
    del research["layers.0.mlp.up_proj.weight"]
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="missing"):
        convert_model(str(source), str(verifier), "eagle", output_path=str(tmp_path / "o2"))

    source, research = eagle1_checkpoint(tmp_path / "shape")
    research["fc.weight"] = torch.zeros(H, H)
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="do not fit"):
        convert_model(str(source), str(verifier), "eagle", output_path=str(tmp_path / "o3"))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_model(str(empty), str(verifier), "eagle", output_path=str(tmp_path / "o4"))
    with pytest.raises(ValueError, match="unsupported algorithm"):
        convert_model(str(source), str(verifier), "medusa", output_path=str(tmp_path / "o5"))
    with pytest.raises(ValueError, match="verifier config"):
        convert_model(
            str(source), str(tmp_path / "no_verifier"), "eagle", output_path=str(tmp_path / "o6")
        )


# ---------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("reduced_vocab", [True, False], ids=["reduced_vocab", "full_vocab"])
def test_eagle3_conversion(tmp_path: Path, verifier: Path, reduced_vocab: bool) -> None:
    from vllm.transformers_utils.configs import SpeculatorsConfig

    source, research = eagle3_checkpoint(tmp_path / "research", reduced_vocab=reduced_vocab)
    out = tmp_path / "out"
    convert_model(
        str(source),
        str(verifier),
        "eagle3",
        output_path=str(out),
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
    )
    draft_vocab = DRAFT_VOCAB if reduced_vocab else VOCAB
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == draft_vocab
    assert config["norm_before_residual"] is True
    assert config["target_hidden_size"] is None
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["transformer_layer_config"]["max_position_embeddings"] == 1024  # verifier's
    _check_speculators_config(config, "eagle3", verifier)
    _check_modes_as_the_umask_allows(out)

    saved = load_file(str(out / "model.safetensors"))
    expected = {
        (("layers.0." + k[len("midlayer.") :]) if k.startswith("midlayer.") else k): v
        for k, v in research.items()
    }
    if not reduced_vocab:  # identity maps and the verifier's embeddings are filled in
        expected["d2t"] = torch.zeros(VOCAB, dtype=torch.long)
        expected["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
        expected["embed_tokens.weight"] = load_file(str(verifier / "model.safetensors"))[
            "model.embed_tokens.weight"
        ]
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name

    vllm_config = SpeculatorsConfig.from_pretrained(str(out))
    assert vllm_config.draft_vocab_size == draft_vocab
    assert vllm_config.norm_before_residual is True
    assert vllm_config.architectures == ["Eagle3LlamaForCausalLM"]
    assert vllm_config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
    }

    from speculators_vllm016.model import SpeculatorModel
    from speculators_vllm016.models.eagle3 import Eagle3DraftModel

    model = SpeculatorModel.from_pretrained(out)
    assert type(model) is Eagle3DraftModel
    state = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    Eagle3Converter.validate(out, expected)


def test_eagle3_malformed_checkpoints(tmp_path: Path, verifier: Path) -> None:
    source, research = eagle3_checkpoint(tmp_path / "no_layer")
    for key in [k for k in research if k.startswith("midlayer.")]:
        del research[key]
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="missing"):
        convert_model(str(source), str(verifier), "eagle3", output_path=str(tmp_path / "o1"))

    source, research = eagle3_checkpoint(tmp_path / "one_map")
    del research["d2t"]
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="d2t/t2d"):
        convert_model(str(source), str(verifier), "eagle3", output_path=str(tmp_path / "o2"))

    source, research = eagle3_checkpoint(tmp_path / "shape")
    research["fc.weight"] = torch.zeros(H, 2 * H)
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="fc.weight"):
        convert_model(str(source), str(verifier), "eagle3", output_path=str(tmp_path / "o3"))

    source, research = eagle3_checkpoint(tmp_path / "extra")
    research["model.layers.0.foo"] = torch.zeros(1)
    torch.save(research, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="unexpected weights"):
        convert_model(str(source), str(verifier), "eagle3", output_path=str(tmp_path / "o4"))


# ---------------------------------------------------------------- utils and CLI


def test_utils(tmp_path: Path) -> None:
    assert find_vocab_size({"text_config": {"vocab_size": 7}}) == 7
    assert find_vocab_size({"vocab_size": 3, "x": {"vocab_size": 9}}) == 3
    assert find_vocab_size({"a": 1}) is None
    source, weights = eagle1_checkpoint(tmp_path / "ck", hass=True)  # safetensors
    assert ensure_checkpoint_is_local(source) == source
    assert load_checkpoint_config(source)["hidden_size"] == H
    loaded = load_checkpoint_weights(source)
    assert sorted(loaded) == sorted(weights)
    assert detect_fusion_bias_and_layernorms(loaded) == (True, True)
    (source / "model.safetensors").unlink()
    (source / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="weight_map"):  # shards are read; a bad index is refused
        load_checkpoint_weights(source)
    (source / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_checkpoint_config(source)


def test_cli_convert(tmp_path: Path, verifier: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from speculators_vllm016.cli.convert import convert

    app = typer.Typer()
    app.command()(convert)
    app.command("noop")(lambda: None)  # two commands, so "convert" is a subcommand as in the app
    source, _ = eagle1_checkpoint(tmp_path / "research")
    out = tmp_path / "out"
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "convert",
            str(source),
            "--verifier",
            str(verifier),
            "--algorithm",
            "eagle",
            "--output-path",
            str(out),
            "--algorithm-kwargs",
            '{"fusion_bias": true}',
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["fusion_bias"] is True
    bad = runner.invoke(
        app, ["convert", str(source), "--verifier", str(verifier), "--algorithm", "medusa"]
    )
    assert bad.exit_code != 0 and "medusa" in bad.output
    bad = runner.invoke(
        app,
        [
            "convert",
            str(source),
            "--verifier",
            str(verifier),
            "--algorithm",
            "eagle",
            "--algorithm-kwargs",
            "[1]",
        ],
    )
    assert bad.exit_code != 0
