"""`speculators train --draft-arch mla` (#47 item 1) as a user runs it, on the tiny DeepSeek-V3
and the tiny Kimi-K2.5 wrapper: the checkpoint is the flat `Eagle3DeepseekV2ForCausalLM` layout,
a run stopped after an epoch and resumed ends bit for bit where the uninterrupted run ends, a
fine-tune from the MLA draft starts from it exactly, and the wrong target or flag is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from speculators_vllm016.__main__ import app
from speculators_vllm016.cli.train import main
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import Eagle3DraftModel
from speculators_vllm016.train.train_step import TrainStep
from tests.kimi_variants import with_remote_code
from tests.training_fixtures import (
    FIXED_SCHEDULE,
    finished_checkpoints,
    train_args,
    write_dataset,
    write_vocab_maps,
)

MLA = ("--draft-arch", "mla")


@pytest.fixture(scope="module")
def deepseek_data(tiny_deepseek_v3, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mla_data")
    data = write_dataset(tiny_deepseek_v3, root / "data", [30, 45, 52, 38], layer_ids=[0, 1, 1, 2])
    write_vocab_maps(data, 512, root)
    return data


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_mla_run_saves_the_vllm_layout_and_resumes_bit_for_bit(
    tiny_deepseek_v3, deepseek_data, tmp_path
):
    whole = tmp_path / "whole"
    assert main(train_args(tiny_deepseek_v3, deepseek_data, whole, *MLA, *FIXED_SCHEDULE)) == 0
    last = whole / "1"  # the last epoch's
    config = json.loads((last / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v3" and "speculators_config" not in config
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["v_head_dim"]) == (128, 64, 64)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert config["speculators_draft"]["speculators_config"]["verifier"]["name_or_path"] == str(
        tiny_deepseek_v3
    )
    draft = SpeculatorModel.from_pretrained(last, verifier_attachment_mode="detached")
    assert isinstance(draft, Eagle3DraftModel)
    assert draft.config.transformer_layer_config.model_type == "deepseek_v3"

    stopped = tmp_path / "stopped"
    epoch_one = train_args(tiny_deepseek_v3, deepseek_data, stopped, *MLA, *FIXED_SCHEDULE)
    epoch_one[epoch_one.index("--epochs") + 1] = "1"
    assert main(epoch_one) == 0
    assert "1" not in finished_checkpoints(stopped)
    assert main(train_args(tiny_deepseek_v3, deepseek_data, stopped, *MLA, *FIXED_SCHEDULE)) == 0
    resumed = _weights(stopped / "1")
    for name, tensor in _weights(last).items():
        assert torch.equal(resumed[name], tensor), name


def test_mla_fine_tune_starts_from_the_draft_exactly(
    tiny_deepseek_v3, deepseek_data, tmp_path, monkeypatch, capsys
):
    first = tmp_path / "first"
    one_step = ("--epochs", "1", "--max-steps", "1")
    assert main(train_args(tiny_deepseek_v3, deepseek_data, first, *MLA, *one_step)) == 0
    draft = first / "0"
    seen: dict = {}
    step = TrainStep.__call__

    def watched(self, row):
        if not seen:
            seen.update({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return step(self, row)

    monkeypatch.setattr(TrainStep, "__call__", watched)
    fine = tmp_path / "fine"
    tune = train_args(
        tiny_deepseek_v3, deepseek_data, fine, *MLA, *one_step, "--from-pretrained", str(draft)
    )
    assert main(tune) == 0
    for name, tensor in _weights(draft).items():
        assert torch.equal(seen[name], tensor.to(seen[name].dtype)), name
    llama = train_args(tiny_deepseek_v3, deepseek_data, tmp_path / "no", "--from-pretrained")
    assert main([*llama, str(draft)]) == 2
    # A window is the Llama layer's: an MLA draft cannot take one (one line, both flags named).
    capsys.readouterr()
    windowed = train_args(tiny_deepseek_v3, deepseek_data, tmp_path / "no", *MLA)
    assert main([*windowed, "--from-pretrained", str(draft), "--sliding-window", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sliding-window" in err[0] and "--from-pretrained" in err[0], err
    assert not (tmp_path / "no").exists()

    # `speculators eval --engine hf` reads the flat layout (verifier and k from speculators_draft).
    chat = tmp_path / "chat.jsonl"
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
    row = {"conversations": turns}
    chat.write_text(json.dumps(row) + "\n")
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        app,
        ["eval", "--draft", str(draft), "--data-path", str(chat), "--max-new-tokens", "8"]
        + ["--ignore-eos", "--engine", "hf", "--output-json", str(out), "--no-progress"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())["drafts"][0]
    assert report["generated_tokens"] == 8 and report["num_drafts"] > 0


def test_mla_on_the_kimi_wrapper_and_refused_on_a_llama(
    tiny_kimi_k25, tiny_llama, deepseek_data, training_data, tmp_path, capsys
):
    kimi = with_remote_code(tiny_kimi_k25, tmp_path / "kimi")
    save = tmp_path / "kimi_save"
    assert (
        main(train_args(kimi, deepseek_data, save, *MLA, "--epochs", "1", "--max-steps", "1")) == 0
    )
    config = json.loads((save / "0" / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["vocab_size"] == 512
    capsys.readouterr()
    refused = tmp_path / "refused"
    assert main(train_args(tiny_llama, training_data, refused, *MLA)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-arch mla" in err[0] and "'llama'" in err[0], err
    assert not refused.exists()
