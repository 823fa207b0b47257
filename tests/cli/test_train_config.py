"""`speculators train --config job.yaml`: the job config's fields in a file, flags over them, the
resolved config beside the checkpoints, and help text from the fields' docstrings."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from speculators_vllm016.cli.train import build_parser, config_from_argv, main
from speculators_vllm016.train.jobs.job_config import (
    CONFIG_FILE,
    JobConfigError,
    TrainJobConfig,
    all_fields,
    config_fields,
    load_job_config,
    save_job_config,
)
from speculators_vllm016.train.jobs.job_sections import TrainingConfig
from speculators_vllm016.utils.field_docs import field_docs
from tests.training_fixtures import train_args

JOB = """\
model:
  verifier_name_or_path: some/model
  ttt_steps: 4
training:
  epochs: 3
  lr: 3e-5
runtime:
  device: cpu
online:
  layer_ids: [0, 1, 2, 3]
"""


def test_yaml_sets_fields_and_flags_override_them(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    config, _ = config_from_argv(["--config", str(job), "--epochs", "5"])
    assert config.model.verifier_name_or_path == "some/model" and config.model.ttt_steps == 4
    assert config.training.epochs == 5  # the flag wins
    assert config.training.lr == 3e-5  # YAML 1.1 reads 3e-5 as text; the field makes it a float
    assert config.runtime.device == "cpu" and config.online.output.layer_ids == [0, 1, 2, 3]
    assert config.training.total_seq_len == 8192  # neither: the default
    # The file gives the required --verifier-name-or-path; a flag still replaces it.
    again, _ = config_from_argv(["--config", str(job), "--verifier-name-or-path", "other"])
    assert again.model.verifier_name_or_path == "other"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("training:\n  epoch: 3\n", "unknown key 'training.epoch'"),
        ("optim:\n  lr: 1.0\n", "unknown key 'optim'"),
        ("training:\n  epochs: three\n", "'training.epochs' must be an integer, got 'three'"),
        (
            "training:\n  scheduler_type: step\n",
            "'training.scheduler_type' must be one of linear, cosine, none",
        ),
        ("model: [1, 2]\n", "'model' must be a mapping of its fields"),
        ("model:\n  num_layers: [1\n", "is not valid YAML"),
        # Never truncated: 2.5 epochs is not 2, true is not 1 layer, layer 1.5 is not layer 1.
        ("training:\n  epochs: 2.5\n", "'training.epochs' must be an integer, got 2.5"),
        ("training:\n  max_steps: 7.9\n", "'training.max_steps' must be an integer, got 7.9"),
        ("model:\n  num_layers: true\n", "'model.num_layers' must be an integer, got True"),
        (
            "online:\n  layer_ids: [0, 1.5]\n",
            "'online.layer_ids' must be a list of integers, got [0, 1.5]",
        ),
        (
            "online:\n  layer_ids: [0, true]\n",
            "'online.layer_ids' must be a list of integers, got [0, True]",
        ),
        ("online:\n  layer_ids: 3\n", "'online.layer_ids' must be a list of integers, got 3"),
    ],
)
def test_a_bad_job_file_is_a_one_line_error_naming_the_key(tmp_path, capsys, text, message):
    job = tmp_path / "job.yaml"
    job.write_text(text)
    with pytest.raises(JobConfigError, match="job.yaml"):
        load_job_config(job)
    assert main(["--config", str(job), "--verifier-name-or-path", "m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_whole_floats_are_integers_in_a_job_file(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("training:\n  epochs: 3.0\nonline:\n  layer_ids: [0, 2.0]\n")
    config = load_job_config(job)
    assert config.training.epochs == 3 and type(config.training.epochs) is int
    assert config.online.output.layer_ids == [0, 2] and all(
        type(v) is int for v in config.online.output.layer_ids
    )


def test_the_resolved_config_round_trips(tmp_path):
    config, _ = config_from_argv(
        [
            "--verifier-name-or-path",
            "m",
            "--layer-ids",
            "1",
            "2",
            "--no-teacher-forcing",
            "--online",
            "--lr",
            "0.002",
        ]
    )
    path = save_job_config(config, tmp_path / CONFIG_FILE)
    assert load_job_config(path) == config
    assert [p.name for p in tmp_path.iterdir()] == [CONFIG_FILE]  # no temporary left behind
    from_file, _ = config_from_argv(["--config", str(path)])
    assert from_file == config


def test_training_writes_the_resolved_config_beside_the_checkpoints(
    tiny_llama, training_data, tmp_path
):
    save = tmp_path / "save"
    job = tmp_path / "job.yaml"
    job.write_text("training:\n  max_steps: 1\n  weight_decay: 0.5\n")
    assert main(["--config", str(job), *train_args(tiny_llama, training_data, save)]) == 0
    written = load_job_config(save / CONFIG_FILE)
    assert written.training.max_steps == 1 and written.training.weight_decay == 0.5
    assert written.model.verifier_name_or_path == str(tiny_llama)
    assert written.checkpoint.save_path == str(save) and written.training.epochs == 2


def test_help_is_the_fields_docstrings(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for section, spec in all_fields():
        assert spec.doc, f"{section}.{spec.name} has no docstring"
    assert " ".join(field_docs(TrainingConfig)["teacher_forcing"].split()) in text
    assert "Passes over the training files (0.3.0's default)." in text
    assert "--config" in text


def test_every_field_is_one_flag_and_one_yaml_key():
    parser = build_parser()
    dests = {action.dest for action in parser._actions} - {"help", "config"}
    assert dests == set(TrainJobConfig().flat())
    assert len(all_fields()) == len(dests)


def test_the_online_flags_are_datagens_flags():
    """`speculators datagen`'s flags and the online section's come from the same option fields
    (`cli.field_flags`): same names, defaults, types, choices and help in both (and 0.3.0's
    train script)."""
    from speculators_vllm016.cli.datagen import build_parser as datagen_parser

    datagen = {action.dest: action for action in datagen_parser()._actions}
    train = {action.dest: action for action in build_parser()._actions}

    def shape(action: argparse.Action) -> tuple:
        choices = list(action.choices) if action.choices is not None else None
        return (action.default, action.type, choices, action.nargs, type(action).__name__)

    online = TrainJobConfig().online
    shared = 0
    for spec in config_fields(type(online)):
        if len(spec.path) != 2:
            continue  # the online section's own fields
        part = getattr(online, spec.path[0])
        mine = next(f for f in config_fields(type(part)) if f.name == spec.path[1])
        action = datagen[mine.dest]
        assert shape(train[spec.dest]) == shape(action), spec.flag
        assert action.help.replace("%%", "%").startswith(mine.doc), mine.flag
        assert train[spec.dest].help.replace("%%", "%").startswith(mine.doc), spec.flag
        shared += 1
    assert shared == 27  # 23, --storage-dtype, --chat-template-kwargs, the two session flags


def test_every_datagen_option_field_is_one_datagen_flag():
    """A field added to a datagen options part (with its docstring) is a flag of `speculators
    datagen` with that docstring as its help; nothing else declares it."""
    from speculators_vllm016.cli.datagen import build_parser as datagen_parser
    from speculators_vllm016.data_generation.options import _PART_OF

    actions = {action.dest: action for action in datagen_parser()._actions}
    for name in _PART_OF:
        dest = "no_progress" if name == "show_progress" else name
        assert dest in actions, name
        assert actions[dest].help, name


def test_the_cli_and_the_library_build_the_same_config():
    args = build_parser().parse_args(["--verifier-name-or-path", "m", "--epochs", "2", "--online"])
    from speculators_vllm016.cli.train import config_from_args

    config = config_from_args(args)
    assert config.training.epochs == 2 and config.online.enabled
    assert config == TrainJobConfig.from_dict(
        {
            "model": {"verifier_name_or_path": "m"},
            "training": {"epochs": 2},
            "online": {"enabled": True},
        }
    )
    assert Path(config.checkpoint.save_path) == Path("./checkpoints")
