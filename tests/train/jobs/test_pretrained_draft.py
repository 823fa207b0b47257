"""`speculators train --from-pretrained DRAFT`: a fine-tune starts from the draft exactly, in
each layout (ours, speculators 0.3.0's, a research checkpoint through the converter), with the
draft's vocabulary maps unless the run names its own; a save path with checkpoints resumes them
instead; a hub id goes through `snapshot_download`, and one that cannot be had is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from speculators_vllm016.cli.train import build_parser, main
from speculators_vllm016.train.draft_contract import loss_and_metrics
from speculators_vllm016.train.jobs.job_config import TrainJobConfig, TrainSetupError
from speculators_vllm016.train.jobs.pretrained_draft import VERIFIER_COPIES, locate_draft
from speculators_vllm016.train.train_step import TrainStep
from tests.train.pretrained_drafts import (
    draft_variant,
    train_ours,
    write_030_draft,
    write_modelopt_draft,
    write_research_draft,
    write_speculators07_draft,
    write_torchspec_draft,
)
from tests.training_fixtures import (
    finished_checkpoints,
    train_args,
    write_dataset,
    write_vocab_maps,
)

FINE_TUNE = ("--max-steps", "1", "--epochs", "1")


@pytest.fixture(scope="module")
def ours(tiny_llama, training_data, tmp_path_factory) -> Path:
    return train_ours(tiny_llama, training_data, tmp_path_factory.mktemp("ours") / "save")


@pytest.fixture
def first_step(monkeypatch) -> dict:
    """What the trainer's first step started from: the model's weights, the row, the call's
    options, and the loss the step reported (the real step runs; this only looks)."""
    seen: dict = {}
    step = TrainStep.__call__

    def watched(self, row):
        if seen:
            return step(self, row)
        seen["weights"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        seen["row"], seen["options"] = row, dict(self.call_options)
        metrics = step(self, row)
        seen["loss"] = metrics["loss"]
        return metrics

    monkeypatch.setattr(TrainStep, "__call__", watched)
    return seen


def _evaluate_draft(folder: Path, verifier: Path, row, options: dict) -> float:
    """The loss of the draft in `folder` loaded the way eval loads drafts (`from_pretrained`),
    with the verifier's norm and head rows as training targets, on the trainer's first row."""
    from speculators_vllm016.model import SpeculatorModel

    draft = SpeculatorModel.from_pretrained(folder, verifier_attachment_mode="detached").float()
    draft.load_verifier_weights(str(verifier))  # the targets' norm and head (and the embeddings)
    draft.load_state_dict(load_file(folder / "model.safetensors"), strict=False)  # the draft's own
    loss, _ = loss_and_metrics(draft(**row.inputs, **options))
    return float(loss.detach())


def _served(folder: Path) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in load_file(folder / "model.safetensors").items() if k not in VERIFIER_COPIES
    }


def _assert_started_from(seen: dict, weights: dict[str, torch.Tensor]) -> None:
    assert seen, "the trainer made no step"
    for name, tensor in weights.items():
        started = seen["weights"][name]
        assert torch.equal(started, tensor.to(started.dtype)), (
            f"{name} is not the draft's at step 0"
        )


def test_ours_step_0_is_the_draft_bit_for_bit_and_its_loss_is_the_drafts(
    ours, tiny_llama, training_data, tmp_path, first_step
):
    save = tmp_path / "save"
    assert (
        main(
            train_args(tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(ours))
        )
        == 0
    )
    _assert_started_from(first_step, _served(ours))
    assert first_step["loss"] == _evaluate_draft(
        ours, tiny_llama, first_step["row"], first_step["options"]
    )
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert written["speculators_config"]["verifier"]["name_or_path"] == str(tiny_llama)


def test_a_030_draft_loads_exactly_and_gets_the_runs_fused_layers(
    ours, tiny_llama, training_data, tmp_path, first_step
):
    draft = write_030_draft(ours, tmp_path / "draft_030")
    save = tmp_path / "save"
    assert (
        main(
            train_args(tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(draft))
        )
        == 0
    )
    _assert_started_from(first_step, _served(draft))
    assert first_step["loss"] == _evaluate_draft(
        draft, tiny_llama, first_step["row"], first_step["options"]
    )
    # 0.3.0 never wrote the fused layers; the fine-tune records the data's, as vLLM numbers them.
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_a_research_draft_goes_through_the_converter(
    ours, tiny_llama, training_data, tmp_path, first_step
):
    from speculators_vllm016.convert.entrypoints import convert_model

    research = write_research_draft(ours, tmp_path / "research")
    save = tmp_path / "save"
    assert (
        main(
            train_args(
                tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(research)
            )
        )
        == 0
    )
    # What `speculators convert` writes for the same checkpoint is what training started from.
    converted = tmp_path / "converted"
    convert_model(
        str(research), str(tiny_llama), "eagle3", str(converted), norm_before_residual=True
    )
    _assert_started_from(first_step, _served(converted))
    assert first_step["loss"] == _evaluate_draft(
        converted, tiny_llama, first_step["row"], first_step["options"]
    )


def test_a_deepseek_v3_draft_fine_tunes_exactly(tiny_deepseek_v3, tmp_path, first_step):
    """Kimi-K2's architecture: the draft's own layer config (not the verifier's MLA shape) is
    what the fine-tune builds, from the draft's weights exactly."""
    root = tmp_path / "deepseek"
    # 3 layers: fused 0, 1, 1 (datagen's numbering) and the last as the teacher.
    data = write_dataset(
        tiny_deepseek_v3, root / "data", [24 + 9 * i for i in range(8)], layer_ids=[0, 1, 1, 2]
    )
    write_vocab_maps(data, 512, root)
    draft = train_ours(tiny_deepseek_v3, data, root / "base")
    first_step.clear()  # the base run's step is not the fine-tune's
    save = root / "save"
    assert (
        main(train_args(tiny_deepseek_v3, data, save, *FINE_TUNE, "--from-pretrained", str(draft)))
        == 0
    )
    _assert_started_from(first_step, _served(draft))
    assert first_step["loss"] == _evaluate_draft(
        draft, tiny_deepseek_v3, first_step["row"], first_step["options"]
    )
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert written["speculators_config"]["verifier"]["architectures"] == ["DeepseekV3ForCausalLM"]


def test_without_maps_of_its_own_the_run_keeps_the_drafts_and_saves_them(
    ours, tiny_llama, training_data, tmp_path, capfd
):
    save = tmp_path / "save"
    argv = train_args(tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(ours))
    for flag in ("--d2t-path", "--t2d-path"):
        del argv[argv.index(flag) : argv.index(flag) + 2]
    capfd.readouterr()
    assert main(argv) == 0
    # The start is said as it is (#50 item 13: it logged "starting from scratch").
    err = capfd.readouterr().err
    assert f"starting from the weights of --from-pretrained {ours}" in err, err[-3000:]
    assert "from scratch" not in err
    served = load_file(ours / "model.safetensors")
    assert np.array_equal(np.load(save / "d2t.npy"), served["d2t"].numpy())
    assert np.array_equal(np.load(save / "t2d.npy"), served["t2d"].numpy())


def test_a_save_path_with_checkpoints_resumes_them_without_reading_the_draft(
    ours, tiny_llama, training_data, tmp_path
):
    save = tmp_path / "save"
    assert (
        main(
            train_args(tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(ours))
        )
        == 0
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("not json")
    argv = train_args(
        tiny_llama,
        training_data,
        save,
        "--max-steps",
        "2",
        "--epochs",
        "1",
        "--from-pretrained",
        str(broken),
    )
    assert main(argv) == 0  # resumed: the (unreadable) draft was never read
    assert finished_checkpoints(save)[-1] == "0-step2"
    # A fresh run over the same folder does read it, and refuses it before writing anything.
    assert main([*argv, "--no-resume-from-checkpoint"]) == 2


@pytest.mark.parametrize(
    ("name", "shape"),
    [("fc.weight", (256, 3 * 128)), ("layers.0.mlp.down_proj.weight", (256, 256))],
)
def test_a_weight_of_its_rank_but_another_shape_is_refused(
    ours, tiny_llama, training_data, tmp_path, capsys, name, shape
):
    """Same rank as the config's tensor, other sizes: only the shapes themselves tell them apart
    (a check of ranks, or of names, lets the file through to fail half-way into the load)."""

    def reshaped(tensors: dict) -> None:
        assert tensors[name].dim() == len(shape) and tuple(tensors[name].shape) != shape
        tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)

    draft = draft_variant(ours, tmp_path / "draft", weights=reshaped)
    save = tmp_path / "save"
    assert main(train_args(tiny_llama, training_data, save, "--from-pretrained", str(draft))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"of another shape than its config says ['{name}']" in err[0], err
    assert not save.exists()


def test_help_says_it_seeds_a_fresh_run_only():
    text = " ".join(build_parser().format_help().split())
    assert "--from-pretrained" in text and "seeds a fresh run only" in text
    assert "resumes them instead" in text and "fresh optimizer and schedule" in text
    config = TrainJobConfig.from_dict({"model": {"from_pretrained": "org/draft"}})
    assert config.model.from_pretrained == "org/draft"


def test_a_hub_id_is_downloaded_with_snapshot_download(ours, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, allow_patterns=None, **_):
        calls.append((repo_id, allow_patterns))
        return str(ours)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert locate_draft("org/eagle3-draft") == ours
    assert calls == [("org/eagle3-draft", ["*.json", "*.safetensors", "*.bin"])]


def test_a_hub_id_that_cannot_be_had_is_one_line(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(TrainSetupError) as caught:
        locate_draft("org/not-a-draft")
    message = str(caught.value)
    assert (
        "\n" not in message and "org/not-a-draft" in message and "cannot be downloaded" in message
    )


def test_a_kimi_k25_draft_fine_tunes_exactly(tiny_deepseek_v3, tiny_kimi_k25, tmp_path, first_step):
    """Users start from public Kimi-K2.5 drafts: a draft trained against the wrapper (its config
    names `KimiK25ForConditionalGeneration`) seeds a fine-tune against the wrapper, exactly. The
    data is the DeepSeek-V3's inside it (same weights, so the same fingerprint)."""
    root = tmp_path / "kimi"
    data = write_dataset(
        tiny_deepseek_v3, root / "data", [24 + 9 * i for i in range(8)], layer_ids=[0, 1, 1, 2]
    )
    write_vocab_maps(data, 512, root)
    draft = train_ours(tiny_kimi_k25, data, root / "base")
    first_step.clear()
    save = root / "save"
    assert (
        main(train_args(tiny_kimi_k25, data, save, *FINE_TUNE, "--from-pretrained", str(draft)))
        == 0
    )
    _assert_started_from(first_step, _served(draft))
    assert first_step["loss"] == _evaluate_draft(
        draft, tiny_kimi_k25, first_step["row"], first_step["options"]
    )
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    assert written["speculators_config"]["verifier"]["architectures"] == [
        "KimiK25ForConditionalGeneration"
    ]
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]


@pytest.fixture(scope="module")
def ours31(tiny_llama, training_data, tmp_path_factory) -> Path:
    """An EAGLE-3.1 draft our trainer wrote (`--fc-norm --norm-output`), two steps in."""
    save = tmp_path_factory.mktemp("ours31") / "save"
    flags = ("--max-steps", "2", "--epochs", "1", "--fc-norm", "--norm-output")
    assert main(train_args(tiny_llama, training_data, save, *flags)) == 0
    return save / finished_checkpoints(save)[-1]


def test_an_eagle31_draft_step_0_is_the_draft_bit_for_bit(
    ours31, tiny_llama, training_data, tmp_path, first_step
):
    save = tmp_path / "save"
    flags = (*FINE_TUNE, "--from-pretrained", str(ours31), "--fc-norm", "--norm-output")
    assert main(train_args(tiny_llama, training_data, save, *flags)) == 0
    served = _served(ours31)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(served)
    _assert_started_from(first_step, served)
    # The loss of the first step is the draft's own, with its norms and normed feedback.
    assert first_step["loss"] == _evaluate_draft(
        ours31, tiny_llama, first_step["row"], first_step["options"]
    )
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    assert (written["fc_norm"], written["norm_output"]) == (True, True)


def test_eagle31_switches_must_match_the_draft(
    ours31, ours, tiny_llama, training_data, tmp_path, capsys
):
    save = tmp_path / "save"
    plain = (*FINE_TUNE, "--from-pretrained", str(ours31))
    assert main(train_args(tiny_llama, training_data, save, *plain)) == 2
    err = capsys.readouterr().err
    assert "fc_norm: the draft has fc_norm=True, this run leaves out --fc-norm" in err
    assert "norm_output: the draft has norm_output=True" in err
    extra = (*FINE_TUNE, "--from-pretrained", str(ours), "--norm-output")
    assert main(train_args(tiny_llama, training_data, save, *extra)) == 2
    assert "norm_output: the draft has norm_output=False, this run gives --norm-output" in (
        capsys.readouterr().err
    )
    assert not save.exists()


def test_fc_norm_and_norm_before_fc_are_refused_together(
    tiny_llama, training_data, tmp_path, capsys
):
    save = tmp_path / "save"
    both = ("--epochs", "1", "--fc-norm", "--norm-before-fc")
    assert main(train_args(tiny_llama, training_data, save, *both)) == 2
    assert "--fc-norm and --norm-before-fc exclude each other" in capsys.readouterr().err
    assert not save.exists()


@pytest.mark.parametrize("source", ["torchspec", "modelopt", "speculators07"])
def test_a_draft_from_another_tool_starts_bit_for_bit(
    source, ours, tiny_llama, training_data, tmp_path, first_step
):
    """TorchSpec and Model Optimizer number a fused layer by the target layer that outputs it
    (the data's datagen ids [0, 1, 2]); their drafts must land on the data's fused layers
    [1, 2, 3] in vLLM's numbering, or draft_match would refuse them."""
    if source == "torchspec":
        draft = write_torchspec_draft(ours, tmp_path / "draft", [0, 1, 2])
        flags = ()
    elif source == "modelopt":
        draft = write_modelopt_draft(ours, tmp_path / "draft", [0, 1, 2])
        flags = ()
    else:
        draft = write_speculators07_draft(ours, tmp_path / "draft")
        flags = ("--norm-before-fc", "--norm-output")
    save = tmp_path / "save"
    args = train_args(tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(draft))
    assert main([*args, *flags]) == 0
    stored = {
        name.replace("midlayer.", "layers.0."): tensor
        for name, tensor in load_file(draft / "model.safetensors").items()
        if name not in ("d2t", "t2d", "embed_tokens.weight")
    }
    _assert_started_from(first_step, stored)
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    if source == "speculators07":
        assert (written["norm_before_fc"], written["norm_output"]) == (True, True)
    else:  # their first layer keeps the residual before hidden_norm
        assert written["norm_before_residual"] is False


def test_a_draft_whose_ids_are_read_in_the_wrong_numbering_is_refused(
    ours, tiny_llama, training_data, tmp_path, capsys
):
    """Model Optimizer's ids are outputs of layers: [1, 2, 3] there are vLLM's [2, 3, 4], which
    the data (fused [1, 2, 3]) does not hold: refused, not trained on the wrong states."""
    draft = write_modelopt_draft(ours, tmp_path / "draft", [1, 2, 3])
    save = tmp_path / "save"
    args = train_args(tiny_llama, training_data, save, *FINE_TUNE, "--from-pretrained", str(draft))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "[2, 3, 4]" in err
    assert not save.exists()


def _with_window(window: int):
    def edit(values: dict) -> None:
        layer = values["transformer_layer_config"]
        layer["layer_types"] = ["sliding_attention"] * int(layer["num_hidden_layers"])
        layer["sliding_window"] = window

    return edit


def _written_window(save: Path) -> tuple[list | None, int | None]:
    written = json.loads((save / finished_checkpoints(save)[-1] / "config.json").read_text())
    layer = written["transformer_layer_config"]
    return layer.get("layer_types"), layer.get("sliding_window")


def test_sliding_window_applies_to_the_draft_and_is_saved(
    ours, tiny_llama, training_data, tmp_path, first_step
):
    """A window changes no weight: `--sliding-window` fine-tunes the draft's weights under it,
    and the saved config (what vLLM serves) has it; step 0's loss is that of the draft read
    with the window, not without."""
    save = tmp_path / "save"
    flags = (*FINE_TUNE, "--from-pretrained", str(ours), "--sliding-window", "4")
    assert main(train_args(tiny_llama, training_data, save, *flags)) == 0
    assert _written_window(save) == (["sliding_attention"], 4)
    _assert_started_from(first_step, _served(ours))
    windowed = draft_variant(ours, tmp_path / "windowed", config=_with_window(4))
    loss = _evaluate_draft(windowed, tiny_llama, first_step["row"], first_step["options"])
    assert first_step["loss"] == loss
    full = _evaluate_draft(ours, tiny_llama, first_step["row"], first_step["options"])
    assert full != loss  # the tiny rows are longer than the window: it changes the loss


def test_a_windowed_drafts_window_is_kept_or_replaced_by_the_flag(
    ours, tiny_llama, training_data, tmp_path
):
    draft = draft_variant(ours, tmp_path / "draft", config=_with_window(6))
    kept, replaced = tmp_path / "kept", tmp_path / "replaced"
    plain = (*FINE_TUNE, "--from-pretrained", str(draft))
    assert main(train_args(tiny_llama, training_data, kept, *plain)) == 0
    assert _written_window(kept) == (["sliding_attention"], 6)
    assert (
        main(train_args(tiny_llama, training_data, replaced, *plain, "--sliding-window", "3")) == 0
    )
    assert _written_window(replaced) == (["sliding_attention"], 3)
