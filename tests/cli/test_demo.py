"""`speculators demo`: the README's first command, on a few conversations (one engine)."""

from __future__ import annotations

import json

import pytest
import torch

from speculators_vllm016.cli import demo
from speculators_vllm016.data_generation import vllm_hidden_states_generator as generator_module
from speculators_vllm016.data_generation.sample_io import load_sample

pytestmark = pytest.mark.engine


def test_demo_writes_safetensors_samples_with_the_default_max_model_len(tmp_path, monkeypatch, capsys):
    started = []
    real_init = generator_module.VllmHiddenStatesGenerator.__init__

    def recording_init(self, *args, **kwargs):  # a spy: the real generator still starts
        started.append(kwargs)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(generator_module.VllmHiddenStatesGenerator, "__init__", recording_init)
    root = tmp_path / "demo"
    rc = demo.main([
        "--output-dir", str(root), "--max-samples", "12", "--seq-length", "128",
        "--batch-size", "8", "--output-format", "safetensors", "--no-progress",
    ])
    assert rc == 0
    out = capsys.readouterr().out
    summary = json.loads(next(x for x in out.splitlines() if x.startswith("SUMMARY "))[8:])
    assert summary["samples_written"] == 12 and summary["tokens_per_second"] > 0
    assert len(started) == 1 and started[0]["max_model_len"] == 129  # --seq-length + 1

    data = root / "data"
    names = sorted(p.name for p in data.iterdir() if p.name.startswith("data_") and p.suffix == ".safetensors")
    assert names == sorted(f"data_{i}.safetensors" for i in range(12))
    config = json.loads((data / "data_config.json").read_text())
    assert config["format"]["file_pattern"] == "data_{idx}.safetensors"
    hidden = config["model"]["hidden_size"]
    for name in names:
        sample = load_sample(data / name)
        length = len(sample["input_ids"])
        assert 0 < length <= 128 and sample["loss_mask"].shape == (length,)
        assert 0 < int(sample["loss_mask"].sum()) < length
        assert len(sample["hidden_states"]) == 4
        assert all(layer.shape == (length, hidden) for layer in sample["hidden_states"])
    frequencies = torch.load(root / "token_freq.pt", weights_only=True)
    assert sum(frequencies.values()) > 0
