"""`speculators datagen` says, before any engine starts, whether vLLM can serve a draft for it.

Each run here is refused right after the start-up checks (a folder holding sample files of no
recorded run), so no engine starts; the line is logged before that refusal.
"""

from __future__ import annotations

import logging

import pytest

from speculators_vllm016.data_generation.offline import run_datagen
from speculators_vllm016.data_generation.options import DatagenOptions


def refused_run(model, tmp_path, caplog) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    output = tmp_path / "out"
    output.mkdir()
    (output / "data_0.pt").write_bytes(b"not ours")
    options = DatagenOptions(
        target_model_path=str(model),
        train_data_path=str(chats),
        output_dir=str(output),
        seq_length=64,
        num_preprocessing_workers=1,
        show_progress=False,
    )
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="no record of the run"):
        run_datagen(options)
    return "\n".join(r.getMessage() for r in caplog.records if "EAGLE-3 draft" in r.getMessage())


def test_llama(tiny_llama, tmp_path, caplog):
    assert refused_run(tiny_llama, tmp_path, caplog) == (
        "vLLM 0.16.0 can serve an EAGLE-3 draft for this target"
    )


def test_kimi_k25_with_and_without_the_plugin(tiny_kimi_k25, tmp_path, caplog, monkeypatch):
    assert "with this package's plugin" in refused_run(tiny_kimi_k25, tmp_path / "on", caplog)
    caplog.clear()
    monkeypatch.setenv("SPECULATORS_VLLM_PLUGIN", "0")
    line = refused_run(tiny_kimi_k25, tmp_path / "off", caplog)
    assert line.startswith(
        "vLLM 0.16.0 cannot serve an EAGLE-3 draft for this target: text model "
        "type 'deepseek_v3' is not in vLLM 0.16.0's EAGLE-3 list"
    )
    assert "KimiK25ForConditionalGeneration lacks SupportsEagle3" in line
    assert "switched off" in line
