"""The verifier's config as vLLM 0.16 reads it: wrappers transformers cannot read (Kimi-K2.5) are
read without the folder's code; code runs only with --trust-remote-code, where it is needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from speculators_vllm016.utils.text_config import text_config_of
from speculators_vllm016.utils.verifier_config import load_verifier_config
from tests.kimi_variants import REMOTE_CODE_MARKER, with_remote_code


def test_the_kimi_wrapper_is_read_with_vllms_classes_and_runs_no_folder_code(
    tiny_kimi_k25, tmp_path
):
    folder = with_remote_code(tiny_kimi_k25, tmp_path / "kimi")
    for trust in (False, True):  # vLLM's own class wins over the folder's, as when vLLM serves it
        config = load_verifier_config(str(folder), trust_remote_code=trust)
        assert type(config).__name__ == "KimiK25Config"
        assert config.architectures == ["KimiK25ForConditionalGeneration"]
        text = text_config_of(config)
        assert (text.model_type, text.vocab_size, text.num_hidden_layers, text.hidden_size) == (
            "deepseek_v3",
            512,
            3,
            256,
        )
    assert not (folder / REMOTE_CODE_MARKER).exists()


def test_a_config_only_its_folder_code_can_read_needs_the_flag(tiny_kimi_k25, tmp_path):
    folder = with_remote_code(tiny_kimi_k25, tmp_path / "custom", model_type="kimi_custom")
    with pytest.raises(ValueError, match="--trust-remote-code") as refused:
        load_verifier_config(str(folder))
    assert "\n" not in str(refused.value)
    assert not (folder / REMOTE_CODE_MARKER).exists()
    config = load_verifier_config(str(folder), trust_remote_code=True)
    assert config.model_type == "kimi_custom"
    assert (folder / REMOTE_CODE_MARKER).exists()


def test_no_folder_and_a_file_are_one_line_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="no model folder at") as missing:
        load_verifier_config(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        load_verifier_config(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot read the model config") as empty:
        load_verifier_config(str(tmp_path / "empty"))
    for error in (missing, empty):
        assert "\n" not in str(error.value)


def test_without_vllm_transformers_reads_the_config(tmp_path: Path, monkeypatch):
    # Training machines need no vLLM (the lent GPU image has none): `speculators train` read the
    # verifier's config through vLLM and stopped there with "No module named 'vllm'".
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2).save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "vllm.transformers_utils.config", None)  # import fails
    config = load_verifier_config(str(tmp_path))
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 320, 2)
