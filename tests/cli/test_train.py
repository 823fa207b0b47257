"""`speculators train`: 0.3.0's flags and defaults, and one-line errors that write nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from speculators_vllm016.cli.train import build_parser, main
from speculators_vllm016.data_generation.sample_io import write_sample
from speculators_vllm016.tiny_models import build_tiny_llama
from tests.training_fixtures import train_args


def test_030_flags_parse_with_030_defaults():
    args = build_parser().parse_args(["--verifier-name-or-path", "m"])
    expected = {
        "verifier_name_or_path": "m",
        "data_path": "./data",
        "save_path": "./checkpoints",
        "epochs": 20,
        "lr": 1e-4,
        "no_resume_from_checkpoint": False,
        "logger": "",
        "total_seq_len": 8192,
        "data_format_version": 1,
        "log_dir": "./logs",
        "run_name": None,
        "num_layers": 1,
        "ttt_steps": 3,
        # 0.3.0's d2t.npy/t2d.npy in the working directory silently beat --draft-vocab-size
        # (#29): by default a run's maps are its own, beside its checkpoints.
        "d2t_path": None,
        "t2d_path": None,
        "ttt_step_loss_decay": 1.0,
        # hard-coded in 0.3.0's script, flags here with the same values
        "norm_before_residual": True,
        "prefetch_factor": 4,
        "noise_type": "uniform",
        "noise_std": 0.05,
        "train_ratio": 0.9,
        "split_seed": 0,
        "scheduler_type": "linear",
        "scheduler_warmup_steps": None,
        "max_grad_norm": 1.0,
        "weight_decay": 0.01,
    }
    assert {name: getattr(args, name) for name in expected} == expected
    # D7 fixed by default (true next tokens); 0.3.0's draft-fed steps stay one flag away.
    assert args.teacher_forcing is True
    legacy = build_parser().parse_args(["--verifier-name-or-path", "m", "--no-teacher-forcing"])
    assert legacy.teacher_forcing is False
    flags = build_parser().parse_args(
        [
            "--verifier-name-or-path",
            "m",
            "--no-resume-from-checkpoint",
            "--data-format-version",
            "0",
            "--ttt-steps",
            "5",
            "--ttt-step-loss-decay",
            "0.8",
            "--num-layers",
            "2",
            "--no-norm-before-residual",
            "--logger",
            "tensorboard,wandb",
        ]
    )
    assert flags.no_resume_from_checkpoint and flags.data_format_version == 0
    assert (flags.ttt_steps, flags.ttt_step_loss_decay, flags.num_layers) == (5, 0.8, 2)
    assert flags.norm_before_residual is False and flags.logger == "tensorboard,wandb"


def test_help_names_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in [
        "--checkpoint-freq",
        "--max-steps",
        "--draft-vocab-size",
        "--token-freq-path",
        "--precision",
        "--parallel",
        "--seed",
        "--strict-data",
        "--no-verifier-norm",
        "--legacy-loss-mask-shift",
        "--noise-on-targets",
        "--bf16-optimizer-state",
    ]:
        assert flag in text


def run_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def wide_verifier(tmp_path_factory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("wide") / "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        tokenizer_style=None,
    )


def test_bad_input_gets_one_line_and_writes_nothing(
    tiny_llama, training_data, wide_verifier, tmp_path, capsys
):
    save = tmp_path / "save"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "token_freq.pt").write_bytes(b"x")
    message = run_error(train_args(tiny_llama, empty, save), capsys)
    assert "no sample files" in message and "--data-path" in message

    message = run_error(train_args(wide_verifier, training_data, save), capsys)
    assert "hidden size" in message and "--verifier-name-or-path" in message

    five = tmp_path / "five"
    five.mkdir()
    write_sample(
        five / "data_0.pt",
        {
            "input_ids": torch.arange(8),
            "loss_mask": torch.ones(8, dtype=torch.long),
            "hidden_states": [torch.zeros(8, 256)] * 5,
        },
    )
    message = run_error(train_args(tiny_llama, five, save), capsys)
    assert "5 captured layers" in message and "--layer-ids" in message

    maps = tmp_path / "maps"
    maps.mkdir()
    np.save(maps / "t2d.npy", np.ones(100, dtype=bool))
    np.save(maps / "d2t.npy", np.zeros(100, dtype=np.int64))
    argv = train_args(tiny_llama, training_data, save)
    argv[argv.index("--t2d-path") + 1] = str(maps / "t2d.npy")
    message = run_error(argv, capsys)
    assert "t2d" in message and "512" in message

    argv = train_args(tiny_llama, training_data, save)
    argv[argv.index("--d2t-path") + 1] = str(maps / "missing.npy")
    message = run_error(argv, capsys)
    assert "--draft-vocab-size" in message

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = run_error(train_args(tiny_llama, training_data, blocker / "save"), capsys)
    assert "--save-path" in message

    message = run_error(train_args(tmp_path / "no_model", training_data, save), capsys)
    assert "--verifier-name-or-path" in message
    assert not save.exists(), "a refused run wrote to --save-path"


def test_vocab_maps_from_token_counts(tiny_llama, training_data, tmp_path):
    save = tmp_path / "save"
    argv = train_args(
        tiny_llama, training_data, save, "--draft-vocab-size", "48", "--max-steps", "1"
    )
    argv[argv.index("--d2t-path") + 1] = str(tmp_path / "none_d2t.npy")
    assert main(argv) == 0
    d2t, t2d = np.load(save / "d2t.npy"), np.load(save / "t2d.npy")
    assert d2t.shape == (48,) and t2d.sum() == 48
    counts = torch.load(training_data / "token_freq.pt", weights_only=True)
    most = sorted(counts, key=lambda token: (-counts[token], token))[:48]
    assert sorted(np.flatnonzero(t2d).tolist()) == sorted(most)


@pytest.mark.parametrize("content", ["empty", "not a mapping", "text"])
def test_unreadable_token_counts_are_a_one_line_error(
    tiny_llama, training_data, tmp_path, capsys, content
):
    counts = tmp_path / "token_freq.pt"
    if content == "empty":
        counts.write_bytes(b"")  # torch.load: EOFError with no message
    elif content == "not a mapping":
        torch.save(torch.arange(4), counts)
    else:
        counts.write_text("not a checkpoint")
    save = tmp_path / "save"
    argv = train_args(
        tiny_llama,
        training_data,
        save,
        "--draft-vocab-size",
        "48",
        "--token-freq-path",
        str(counts),
    )
    argv[argv.index("--d2t-path") + 1] = str(tmp_path / "none_d2t.npy")
    message = run_error(argv, capsys)
    assert message.startswith(f"error: cannot read token counts from {counts}"), message
    assert not save.exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--train-ratio", "0"),
        ("--train-ratio", "1.5"),
        ("--num-workers", "-1"),
        ("--max-steps", "0"),
        ("--scheduler-warmup-steps", "-1"),
        ("--scheduler-total-steps", "0"),
        ("--keep-mid-epoch-checkpoints", "-1"),
        ("--sliding-window", "1"),  # shorter than --ttt-steps
    ],
)
def test_bad_numbers_are_refused_before_anything_is_written(
    tiny_llama, training_data, tmp_path, capsys, flag, value
):
    save = tmp_path / "save"
    argv = train_args(tiny_llama, training_data, save)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    message = run_error(argv, capsys)
    assert flag in message
    assert not save.exists() and not (tmp_path / "logs").exists(), "a refused run wrote files"


def test_fsdp_bf16_params_with_ddp_is_refused(tiny_llama, training_data, tmp_path, capsys):
    save = tmp_path / "save"
    message = run_error(
        train_args(tiny_llama, training_data, save, "--parallel", "ddp", "--fsdp-bf16-params"),
        capsys,
    )
    assert "--fsdp-bf16-params applies to --parallel fsdp only" in message
    assert not save.exists()


def test_deterministic_compiles_the_draft_reproducibly(tiny_llama, training_data, tmp_path):
    """`--deterministic` reaches the compiled blocks (the guarantee itself:
    tests/models/test_eagle3_compilation.py); a run without it goes back to the default."""
    from speculators_vllm016.cli.train import main
    from speculators_vllm016.models.eagle3 import model_definitions

    try:
        assert (
            main(
                train_args(
                    tiny_llama, training_data, tmp_path / "a", "--max-steps", "1", "--deterministic"
                )
            )
            == 0
        )
        assert model_definitions._REPRODUCIBLE
        assert main(train_args(tiny_llama, training_data, tmp_path / "b", "--max-steps", "1")) == 0
        assert not model_definitions._REPRODUCIBLE
    finally:
        model_definitions.use_reproducible_compilation(False)


def test_maps_of_two_builds_are_refused_even_when_their_sizes_agree(
    tiny_llama, training_data, tmp_path, capsys
):
    """d2t of one build beside t2d of another (a crash between vocab-mapping's two renames)."""
    counts = torch.load(training_data / "token_freq.pt", weights_only=True)
    other = {token: 1 for token in range(512)}  # another ranking: the top 64 are tokens 0..63
    maps = tmp_path / "maps"
    maps.mkdir()
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, _ = build_vocab_mappings_from_distribution(other, 64, 512)
    _, t2d = build_vocab_mappings_from_distribution(counts, 64, 512)
    np.save(maps / "d2t.npy", d2t.numpy())
    np.save(maps / "t2d.npy", t2d.numpy())
    save = tmp_path / "save"
    argv = train_args(tiny_llama, training_data, save)
    argv[argv.index("--d2t-path") + 1] = str(maps / "d2t.npy")
    argv[argv.index("--t2d-path") + 1] = str(maps / "t2d.npy")
    message = run_error(argv, capsys)
    assert "different maps" in message and "t2d marks" in message
    assert not save.exists()


def test_data_without_data_config_needs_layer_ids_and_then_serves_those_layers(
    tiny_llama, training_data, tmp_path, capsys
):
    """0.3.0's layout from elsewhere (no data_config.json): refused in one line, unless --layer-ids
    names the layers; the draft's config then names them for vLLM (its numbering) (#29 item 7)."""
    import json
    import shutil

    bare = tmp_path / "data"
    shutil.copytree(training_data, bare)
    (bare / "data_config.json").unlink()
    save = tmp_path / "save"
    maps = [
        "--d2t-path",
        str(training_data.parent / "d2t.npy"),
        "--t2d-path",
        str(training_data.parent / "t2d.npy"),
    ]
    message = run_error(train_args(tiny_llama, bare, save, *maps), capsys)
    assert "data_config.json" in message and "--layer-ids" in message, message
    assert not save.exists()
    # With data_config.json, --layer-ids must agree with it.
    message = run_error(
        train_args(tiny_llama, training_data, save, "--layer-ids", "0", "1", "2", "2"), capsys
    )
    assert "--layer-ids 0 1 2 2 differ" in message
    assert not save.exists()

    assert (
        main(
            train_args(
                tiny_llama, bare, save, *maps, "--layer-ids", "0", "1", "2", "3", "--max-steps", "1"
            )
        )
        == 0
    )
    configs = list(save.glob("*/config.json"))
    assert configs
    for path in configs:
        assert json.loads(path.read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


@pytest.mark.parametrize("recorded", [True, False])
def test_a_layer_id_past_the_verifiers_last_layer_is_refused_before_any_work(
    tiny_llama, training_data, tmp_path, capsys, recorded
):
    """The tiny Llama has 4 layers (0..3): layer 4, whether data_config.json records it or
    --layer-ids names it, is one line naming the verifier's depth, and nothing is written."""
    import json
    import shutil

    data = tmp_path / "data"
    shutil.copytree(training_data, data)
    extra = []
    if recorded:
        (data / "data_config.json").write_text(
            json.dumps({"hidden_states": {"layer_ids": [0, 1, 2, 4]}})
        )
    else:
        (data / "data_config.json").unlink()
        extra = ["--layer-ids", "0", "1", "2", "4"]
    save = tmp_path / "save"
    argv = train_args(tiny_llama, data, save, *extra)
    argv[argv.index("--d2t-path") + 1] = str(training_data.parent / "d2t.npy")
    argv[argv.index("--t2d-path") + 1] = str(training_data.parent / "t2d.npy")
    message = run_error(argv, capsys)
    assert "[0, 1, 2, 4]" in message and "the verifier has 4 layers" in message, message
    assert not save.exists() and not (tmp_path / "logs").exists(), "a refused run wrote files"


def test_stray_maps_never_beat_the_draft_vocab_size(
    tiny_llama, training_data, tmp_path, capsys, monkeypatch
):
    """Maps that disagree with --draft-vocab-size stop the run in one line, and maps left in the
    working directory are not read when --draft-vocab-size asks for a vocabulary: it is built
    beside the checkpoints, where a second start of the run finds it (#29 item 4)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    np.save(work / "t2d.npy", np.arange(512) < 100)
    np.save(work / "d2t.npy", np.zeros(100, dtype=np.int64))
    save = tmp_path / "save"
    argv = train_args(
        tiny_llama, training_data, save, "--draft-vocab-size", "200", "--max-steps", "1"
    )
    for flag in ("--d2t-path", "--t2d-path"):  # the flags left out: the default places
        at = argv.index(flag)
        del argv[at : at + 2]
    assert main(argv) == 0
    capsys.readouterr()
    assert np.load(save / "d2t.npy").shape == (200,) and np.load(save / "t2d.npy").sum() == 200
    assert np.load(work / "d2t.npy").shape == (100,)

    # Named maps of another size: one line, nothing written.
    other = tmp_path / "other"
    maps = ["--d2t-path", str(work / "d2t.npy"), "--t2d-path", str(work / "t2d.npy")]
    message = run_error(
        train_args(tiny_llama, training_data, other, "--draft-vocab-size", "200", *maps), capsys
    )
    assert "maps 100 draft tokens but --draft-vocab-size is 200" in message, message
    assert not other.exists()
    # The run's own maps (beside its checkpoints) of another size: the same.
    message = run_error(
        [
            *argv[: argv.index("--draft-vocab-size") + 1],
            "300",
            *argv[argv.index("--draft-vocab-size") + 2 :],
        ],
        capsys,
    )
    assert "maps 200 draft tokens but --draft-vocab-size is 300" in message, message


@pytest.mark.parametrize(
    ("flags", "quiet"),
    [
        (["--online"], True),
        (["--online", "--verbose"], False),
        ([], False),
    ],
)
def test_online_training_keeps_vllms_start_up_lines_off_unless_verbose(monkeypatch, flags, quiet):
    """#37 item 22: as datagen, `train --online` sets vLLM's log level to WARNING before the
    engine starts (seen at the job's first step), unless --verbose; offline training leaves it."""
    import logging
    import os

    from speculators_vllm016.cli import train as train_cli
    from speculators_vllm016.train.jobs.job_config import TrainSetupError

    seen = {}

    def first_step(config, research_reader):
        seen["level"] = os.environ.get("VLLM_LOGGING_LEVEL")
        raise TrainSetupError("stop here")

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(train_cli, "_prepare", first_step)
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    try:
        assert train_cli.main(["--verifier-name-or-path", "no-such-model", *flags]) == 2
    finally:
        vllm_logger.setLevel(before)
    assert seen["level"] == ("WARNING" if quiet else None)
