"""A `--from-pretrained` draft that does not fit the run is refused before anything is written:
exit status 2, one line per mismatch (verifier, its identity, hidden size, both vocabularies, the
maps, the fused layers, the layer count, the norm placement), all of them listed together."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from speculators_vllm016.cli.train import main
from speculators_vllm016.train.jobs.draft_match import RunFacts, draft_mismatches
from speculators_vllm016.train.jobs.pretrained_draft import read_pretrained_draft
from speculators_vllm016.train.vocab_maps import VocabMaps
from tests.train.pretrained_drafts import draft_variant, train_ours, write_research_draft
from tests.training_fixtures import train_args, write_dataset, write_vocab_maps


@pytest.fixture(scope="module")
def ours(tiny_llama, training_data, tmp_path_factory) -> Path:
    return train_ours(tiny_llama, training_data, tmp_path_factory.mktemp("ours") / "save")


def _set(*path: str, value):
    def edit(values: dict) -> None:
        for key in path[:-1]:
            values = values[key]
        values[path[-1]] = value

    return edit


def _wider_target(tensors: dict) -> None:
    tensors["fc.weight"] = torch.zeros(256, 3 * 128, dtype=torch.bfloat16)


def _larger_vocabulary(tensors: dict) -> None:
    tensors["embed_tokens.weight"] = torch.zeros(600, 256, dtype=torch.bfloat16)
    tensors["t2d"] = torch.cat([tensors["t2d"], torch.zeros(88, dtype=torch.bool)])


def _other_embeddings(tensors: dict) -> None:
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] * 2


def _other_maps(folder: Path) -> list[str]:
    """Maps of the draft's size that pick the first 64 tokens: not the ones the draft has."""
    t2d = np.zeros(512, dtype=bool)
    t2d[:64] = True
    np.save(folder / "d2t.npy", np.zeros(64, dtype=np.int64))
    np.save(folder / "t2d.npy", t2d)
    return ["--d2t-path", str(folder / "d2t.npy"), "--t2d-path", str(folder / "t2d.npy")]


def _built_maps(size: int):
    """Flags that have the run build maps of `size` tokens from the data (the draft has 64)."""

    def flags(folder: Path) -> list[str]:
        return [
            "--d2t-path",
            str(folder / "none_d2t.npy"),
            "--t2d-path",
            str(folder / "none_t2d.npy"),
            "--draft-vocab-size",
            str(size),
        ]

    return flags


# kind -> (config edit, tensor edit, extra run flags (a function of a scratch folder), the line)
KINDS = {
    "verifier": (
        _set("speculators_config", "verifier", "architectures", value=["Qwen3ForCausalLM"]),
        None,
        None,
        "verifier: the draft was made for Qwen3ForCausalLM",
    ),
    "identity": (
        None,
        _other_embeddings,
        None,
        "verifier identity: the draft's token embeddings are not",
    ),
    "hidden size": (
        _set("target_hidden_size", value=128),
        _wider_target,
        None,
        "hidden size: the draft reads target states 128 wide (target_hidden_size), the verifier's are 256",
    ),
    "target vocabulary": (
        _set("transformer_layer_config", "vocab_size", value=600),
        _larger_vocabulary,
        None,
        "target vocabulary: the draft embeds 600 tokens, the verifier has 512",
    ),
    "draft vocabulary": (
        None,
        None,
        _built_maps(48),
        "draft vocabulary: the draft predicts 64 tokens (draft_vocab_size), this run's maps",
    ),
    # Smaller than the run's maps: refused as such, not by the maps' comparison (whose line
    # would blame the maps), and not accepted when the draft holds no maps to compare.
    "smaller draft vocabulary": (
        None,
        None,
        _built_maps(96),
        "draft vocabulary: the draft predicts 64 tokens (draft_vocab_size), this run's maps",
    ),
    "maps": (None, None, _other_maps, "vocabulary maps: the draft's d2t/t2d pick other tokens"),
    "fused layers": (
        _set("eagle_aux_hidden_state_layer_ids", value=[0, 2, 3]),
        None,
        None,
        "fused layers: the draft fuses target layers [0, 2, 3] (vLLM's numbering), the data holds [1, 2, 3]",
    ),
    "layers": (
        None,
        None,
        lambda _: ["--num-layers", "2"],
        "layers: the draft has 1 decoder layer, this run --num-layers 2",
    ),
    "norm": (
        None,
        None,
        lambda _: ["--no-norm-before-residual"],
        "norm before residual: the draft has norm_before_residual=True, this run --no-norm-before-residual",
    ),
}


def _refused(argv: list[str], capsys) -> list[str]:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("error: "))  # after log lines
    assert (
        lines[start].startswith("error: --from-pretrained ")
        and "nothing was written" in lines[start]
    ), lines
    return [line.strip() for line in lines[start + 1 :]]


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_mismatch_is_refused_with_its_line(
    kind, ours, tiny_llama, training_data, tmp_path, capsys
):
    config, tensors, flags, line = KINDS[kind]
    draft = draft_variant(ours, tmp_path / "draft", config=config, weights=tensors)
    save = tmp_path / "save"
    argv = train_args(tiny_llama, training_data, save, "--from-pretrained", str(draft))
    lines = _refused([*argv, *(flags(tmp_path) if flags else [])], capsys)
    assert len(lines) == 1 and lines[0].startswith(line), lines
    assert not save.exists(), "a refused fine-tune wrote to --save-path"


def test_every_mismatch_is_listed_together(ours, tiny_llama, training_data, tmp_path, capsys):
    def edit(values: dict) -> None:
        for kind in ("verifier", "fused layers"):
            KINDS[kind][0](values)

    draft = draft_variant(ours, tmp_path / "draft", config=edit, weights=_other_embeddings)
    save = tmp_path / "save"
    argv = train_args(
        tiny_llama,
        training_data,
        save,
        "--from-pretrained",
        str(draft),
        "--num-layers",
        "2",
        "--no-norm-before-residual",
        *_other_maps(tmp_path),
    )
    lines = _refused(argv, capsys)
    kinds = ("verifier", "identity", "layers", "norm", "maps", "fused layers")
    assert [line.split(":")[0] for line in lines] == [KINDS[k][3].split(":")[0] for k in kinds]
    assert not save.exists()


def test_a_draft_whose_weights_do_not_fit_its_config_is_one_line(
    ours, tiny_llama, training_data, tmp_path, capsys
):
    draft = draft_variant(ours, tmp_path / "draft", weights=lambda t: t.pop("fc.weight"))
    save = tmp_path / "save"
    assert main(train_args(tiny_llama, training_data, save, "--from-pretrained", str(draft))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fc.weight" in err[0] and "missing" in err[0], err
    assert not save.exists()


def test_the_fused_layers_a_research_config_records_are_checked(
    ours, tiny_llama, training_data, tmp_path, capsys
):
    research = write_research_draft(ours, tmp_path / "research")
    config = json.loads((research / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]  # where vLLM reads them
    (research / "config.json").write_text(json.dumps(config))
    save = tmp_path / "save"
    lines = _refused(
        train_args(tiny_llama, training_data, save, "--from-pretrained", str(research)), capsys
    )
    assert len(lines) == 1 and lines[0].startswith(KINDS["fused layers"][3]), lines
    assert not save.exists()


def test_a_llama_draft_is_refused_for_a_deepseek_v3_run(ours, tiny_deepseek_v3, tmp_path, capsys):
    """Same widths and vocabulary size, another target: the architecture, the embeddings, the
    maps (of the other data's tokens) and the fused layers say so."""
    data = write_dataset(
        tiny_deepseek_v3, tmp_path / "data", [24, 40, 56, 72], layer_ids=[0, 1, 1, 2]
    )
    write_vocab_maps(data, 512, tmp_path)
    save = tmp_path / "save"
    lines = _refused(
        train_args(tiny_deepseek_v3, data, save, "--from-pretrained", str(ours)), capsys
    )
    assert [line.split(":")[0] for line in lines] == [
        "verifier",
        "verifier identity",
        "vocabulary maps",
        "fused layers",
    ], lines
    assert "LlamaForCausalLM" in lines[0] and "DeepseekV3ForCausalLM" in lines[0]
    assert not save.exists()


@pytest.mark.parametrize("maps_stored", [True, False], ids=["with_maps", "without_maps"])
def test_a_draft_vocabulary_smaller_than_the_runs_maps_is_its_own_mismatch(
    ours, tiny_llama, maps_stored
):
    """The comparison itself (the command refuses a draft without maps earlier, as weights its
    config lacks): a draft predicting 64 tokens against maps of 96 is named for its size, with
    or without maps of its own to compare."""
    draft = read_pretrained_draft(str(ours), str(tiny_llama), norm_before_residual=True)
    if not maps_stored:
        del draft.weights["d2t"], draft.weights["t2d"]
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[:96] = True
    run = RunFacts(
        verifier=str(tiny_llama),
        architectures=["LlamaForCausalLM"],
        hidden_size=256,
        vocab_size=512,
        vocab=VocabMaps(d2t=torch.zeros(96, dtype=torch.long), t2d=t2d, built_from=None),
        vocab_source="the --d2t-path file",
        layer_ids=None,
        aux_ids=None,
        num_layers=1,
        norm_before_residual=True,
        embeddings=None,
    )
    assert draft_mismatches(draft, run) == [
        "draft vocabulary: the draft predicts 64 tokens (draft_vocab_size), this run's maps "
        "(the --d2t-path file) 96"
    ]
