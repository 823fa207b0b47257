"""The verifier as a transformers causal LM for `eval --engine hf`: a Kimi-K2.5 wrapper gives the
DeepSeek-V3 language model inside it (same logits as the plain model on the same weights), with
no code from its folder run and no vision tensor read."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculators_vllm016.models.verifier_lm as verifier_lm
from speculators_vllm016.models.verifier_lm import load_verifier_lm
from tests.kimi_variants import (
    REMOTE_CODE_MARKER,
    int4_variant,
    with_remote_code,
    with_vision_tower,
    without_inner_model,
)

IDS = torch.tensor([[0, 17, 300, 45, 9, 511, 128, 77, 3, 250, 6, 6, 6, 400]])


@pytest.fixture(scope="module")
def reference_logits(tiny_deepseek_v3):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_deepseek_v3), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_the_kimi_wrapper_loads_its_language_model_only(
    tiny_kimi_k25, tmp_path, reference_logits, monkeypatch
):
    folder = with_vision_tower(
        with_remote_code(tiny_kimi_k25, tmp_path / "code"), tmp_path / "kimi"
    )
    requested: list[str] = []
    read = verifier_lm.read_checkpoint_tensors

    def spy(path, names=None, **kwargs):
        requested.extend(names or ["<every tensor>"])
        return read(path, names, **kwargs)

    monkeypatch.setattr(verifier_lm, "read_checkpoint_tensors", spy)
    model = load_verifier_lm(str(folder), torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert torch.equal(_logits(model), reference_logits)
    assert requested and all(name.startswith("language_model.") for name in requested), requested
    assert not (folder / REMOTE_CODE_MARKER).exists()
    assert model.generation_config.eos_token_id == 4  # the text config's end of sequence


def test_the_layout_without_the_inner_model_loads_the_same(
    tiny_kimi_k25, tmp_path, reference_logits
):
    model = load_verifier_lm(
        str(without_inner_model(tiny_kimi_k25, tmp_path / "nvfp4")), torch.float32
    )
    assert torch.equal(_logits(model), reference_logits)


def test_a_plain_model_loads_as_transformers_loads_it(tiny_deepseek_v3, reference_logits):
    assert torch.equal(
        _logits(load_verifier_lm(str(tiny_deepseek_v3), torch.float32)), reference_logits
    )


def test_a_quantized_language_model_is_one_line(tiny_kimi_k25, tmp_path):
    with pytest.raises(ValueError, match="stores its language model quantized") as refused:
        load_verifier_lm(str(int4_variant(tiny_kimi_k25, tmp_path / "int4")), torch.float32)
    assert "\n" not in str(refused.value)


def test_the_kimi_wrapper_from_the_config_eval_read_is_the_same_model_reading_it_no_more(
    tiny_kimi_k25, reference_logits
):
    """eval's set-up reads config.json once and hands it on (`config_dict`): the wrapper's
    language model is then built from it, the same as from vLLM's reading of the folder (which
    opened config.json twice more), and config.json is not opened again."""
    import json

    from tests.reads_once import counting

    config_dict = json.loads((tiny_kimi_k25 / "config.json").read_text())
    with counting({"verifier": tiny_kimi_k25}) as seen:
        model = load_verifier_lm(str(tiny_kimi_k25), torch.float32, config_dict=config_dict)
    assert not [key for bucket in seen.counts().values() for key in bucket if "config.json" in key]
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert torch.equal(_logits(model), reference_logits)
    with counting({"verifier": tiny_kimi_k25}) as before:
        read_again = load_verifier_lm(str(tiny_kimi_k25), torch.float32)
    assert before.vllm["verifier:config.json"] == 2  # what the hand-on saves
    # vLLM's RoPE patching (transformers 4) makes rope_parameters the rope_scaling dict and puts
    # rope_theta in it: neither is read by transformers 4's models (the logits above are equal).
    ours, vllms = model.config.to_dict(), read_again.config.to_dict()
    assert vllms.pop("rope_parameters") is vllms["rope_scaling"]
    assert vllms["rope_scaling"].pop("rope_theta") == ours["rope_theta"]
    assert ours == vllms


def test_a_config_dict_with_the_folders_own_config_class_is_read_as_before(
    tiny_deepseek_v3, tmp_path
):
    """A config.json naming its folder's own config class (`auto_map`) is not built from the
    set-up's reading: with --trust-remote-code that class runs as it would without the reading
    (here the folder then lacks its modeling file: the same error either way)."""
    import json

    from tests.kimi_variants import with_remote_code

    outcomes = []
    for handed_on in (False, True):
        folder = with_remote_code(tiny_deepseek_v3, tmp_path / f"code_{handed_on}")
        config_dict = json.loads((folder / "config.json").read_text()) if handed_on else None
        with pytest.raises(OSError, match="modeling_kimi_k25.py") as refused:
            load_verifier_lm(str(folder), torch.float32, True, config_dict=config_dict)
        outcomes.append((str(refused.value).replace(str(folder), "<folder>"), folder))
    assert outcomes[0][0] == outcomes[1][0]
    assert all((folder / REMOTE_CODE_MARKER).exists() for _, folder in outcomes)


def test_a_wrapper_of_a_model_type_transformers_knows_is_not_read_as_a_plain_model() -> None:
    """A Llava-style wrapper's config.json (its own type `llava` is one transformers has a class
    for): read as the wrapper of a Llama language model, never as a plain causal LM of the
    wrapper's type (whose loading would build the wrapper, vision tower included)."""
    from transformers import LlamaConfig

    text = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 512,
    }
    wrapper = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32},
    }
    assert verifier_lm._plain_config(wrapper) is None
    language = verifier_lm._wrapped_text_config(wrapper)
    assert isinstance(language, LlamaConfig)
    assert (language.hidden_size, language.num_hidden_layers, language.vocab_size) == (64, 2, 512)
    plain = verifier_lm._plain_config(text)  # the same language model's own config.json
    assert isinstance(plain, LlamaConfig) and plain.to_dict() == language.to_dict()
