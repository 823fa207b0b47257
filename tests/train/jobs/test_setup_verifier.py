"""Train reads every target vLLM 0.16 reads (#36 item 1): the Kimi-K2.5 wrapper's config through
vLLM's classes with no code from its folder, its language model's tensors (plain, INT4, NVFP4
names), and a draft config that names the verifier as vLLM loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from speculators_vllm016.cli.train import config_from_argv
from speculators_vllm016.train.jobs.draft_build import build_model
from speculators_vllm016.train.jobs.job_config import TrainSetupError
from speculators_vllm016.train.jobs.setup import prepare
from tests.kimi_variants import (
    REMOTE_CODE_MARKER,
    int4_variant,
    with_remote_code,
    without_inner_model,
)
from tests.training_fixtures import train_args, write_dataset, write_vocab_maps

# The tiny DeepSeek-V3 has 3 layers: 3 fused layers (datagen's numbering) and the last.
LAYER_IDS = [0, 1, 1, 2]


@pytest.fixture(scope="module")
def deepseek_data(tiny_deepseek_v3, tmp_path_factory) -> Path:
    """Sample files from the tiny DeepSeek-V3's hidden states: the tiny Kimi-K2.5's too."""
    root = tmp_path_factory.mktemp("deepseek_data")
    data = write_dataset(tiny_deepseek_v3, root / "data", [24, 40, 33, 57], layer_ids=LAYER_IDS)
    write_vocab_maps(data, 512, root)
    return data


@pytest.fixture(scope="module")
def kimi(tiny_kimi_k25, tmp_path_factory) -> Path:
    """The tiny Kimi-K2.5 with the real folder's auto_map (its code leaves a marker if run)."""
    return with_remote_code(tiny_kimi_k25, tmp_path_factory.mktemp("kimi") / "kimi")


def _prepare(verifier: Path, data: Path, save: Path, *extra: str):
    config, _ = config_from_argv(train_args(verifier, data, save, *extra))
    return config, prepare(config)


def test_the_kimi_wrapper_is_read_as_vllm_reads_it(kimi, tiny_deepseek_v3, deepseek_data, tmp_path):
    config, setup = _prepare(kimi, deepseek_data, tmp_path / "save")
    assert type(setup.verifier_config).__name__ == "KimiK25Config"
    assert type(setup.text_config).__name__ == "DeepseekV3Config"
    assert setup.aux_ids == [1, 2, 2]  # datagen's fused ids + 1 (vLLM's numbering)
    draft = build_model(config, setup)
    saved = draft.config.to_dict()
    assert saved["speculators_config"]["verifier"]["architectures"] == [
        "KimiK25ForConditionalGeneration"
    ]
    assert saved["transformer_layer_config"]["vocab_size"] == setup.text_config.vocab_size == 512
    assert saved["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert not (kimi / REMOTE_CODE_MARKER).exists()
    assert not (tmp_path / "save").exists()

    plain_config, plain_setup = _prepare(tiny_deepseek_v3, deepseek_data, tmp_path / "plain")
    plain = build_model(plain_config, plain_setup)
    # The same initial draft: the verifier tensors it copies are the language model's.
    for name, tensor in plain.state_dict().items():
        assert torch.equal(draft.state_dict()[name], tensor), name


@pytest.mark.parametrize("variant", ["int4", "nvfp4_names"])
def test_release_layouts_give_the_same_draft(
    tiny_kimi_k25, tiny_deepseek_v3, deepseek_data, tmp_path, variant
):
    folder = (int4_variant if variant == "int4" else without_inner_model)(
        tiny_kimi_k25, tmp_path / variant
    )
    config, setup = _prepare(folder, deepseek_data, tmp_path / "save")
    plain_config, plain_setup = _prepare(tiny_deepseek_v3, deepseek_data, tmp_path / "plain")
    draft, plain = (
        build_model(config, setup).state_dict(),
        build_model(plain_config, plain_setup).state_dict(),
    )
    assert all(torch.equal(draft[name], tensor) for name, tensor in plain.items())


def test_a_quantized_lm_head_is_refused_before_anything_is_written(
    tiny_kimi_k25, deepseek_data, tmp_path
):
    folder = int4_variant(tiny_kimi_k25, tmp_path / "int4", pack_lm_head=True)
    with pytest.raises(
        TrainSetupError, match="LM head language_model.lm_head .* is quantized"
    ) as refused:
        _prepare(folder, deepseek_data, tmp_path / "save")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "save").exists()


def test_folder_code_runs_only_with_trust_remote_code(tiny_kimi_k25, deepseek_data, tmp_path):
    folder = with_remote_code(tiny_kimi_k25, tmp_path / "custom", model_type="kimi_custom")
    with pytest.raises(TrainSetupError, match="--trust-remote-code") as refused:
        _prepare(folder, deepseek_data, tmp_path / "save")
    assert "\n" not in str(refused.value)
    assert not (folder / REMOTE_CODE_MARKER).exists()
    with pytest.raises(TrainSetupError, match="no usable hidden_size"):  # read by the stand-in code
        _prepare(folder, deepseek_data, tmp_path / "save", "--trust-remote-code")
    assert (folder / REMOTE_CODE_MARKER).exists()


def test_the_drafts_rope_scaling_is_the_verifiers_without_vllms_copy_of_rope_theta(tmp_path):
    """vLLM's reader puts `rope_theta` into `rope_scaling` (one dict with its `rope_parameters`);
    the draft's Llama layer keeps the verifier's scaling as transformers wrote it."""
    from transformers import LlamaConfig

    from speculators_vllm016.train.jobs.draft_build import build_draft_config
    from speculators_vllm016.train.jobs.setup import verifier_text_config

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_hidden_layers=4,
        intermediate_size=128,
        vocab_size=128,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),
    ).save_pretrained(tmp_path)
    config, text = verifier_text_config(str(tmp_path))
    draft = build_draft_config(
        str(tmp_path),
        config,
        text,
        draft_vocab=32,
        num_layers=1,
        norm_before_residual=True,
        ttt_steps=3,
        aux_layer_ids=[3, 3, 2],
    )
    layer = draft.transformer_layer_config
    assert layer.rope_scaling == scaling and layer.rope_theta == 500000.0


@pytest.mark.parametrize(("last", "refused"), [(2, False), (3, True)])
def test_a_layer_id_the_verifier_does_not_have_is_refused_at_set_up(
    tiny_deepseek_v3, deepseek_data, tmp_path, last, refused
):
    """The tiny DeepSeek-V3 has layers 0-2: data recording layer 2 last is its own; data
    recording layer 3 (= its layer count) was made by another model, and is refused before
    anything is written (the bound itself, not only ids beyond it)."""
    data = tmp_path / "data"
    shutil.copytree(deepseek_data, data)
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(deepseek_data.parent / name, tmp_path / name)
    layer_ids = [*LAYER_IDS[:-1], last]
    (data / "data_config.json").write_text(json.dumps({"hidden_states": {"layer_ids": layer_ids}}))
    save = tmp_path / "save"
    if not refused:
        assert _prepare(tiny_deepseek_v3, data, save)[1].aux_ids == [1, 2, 2]
        return
    with pytest.raises(
        TrainSetupError,
        match=r"the data's layer ids are \[0, 1, 1, 3\], but the verifier has 3 layers",
    ):
        _prepare(tiny_deepseek_v3, data, save)
    assert not save.exists()
