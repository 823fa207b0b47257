"""`speculators train`: train an EAGLE-3 draft on datagen's hidden states.

The flags of 0.3.0's `scripts/train.py` keep their names and defaults; everything 0.3.0 hard-coded
is a flag too. Every flag is a field of `train.jobs.job_config.TrainJobConfig` and its help is that
field's docstring; `--config job.yaml` sets the same fields from a file, and flags given on the
command line override it. This module only parses: the job is `train.jobs.job.run_train_job`.
One process trains on one device (a GPU, else the CPU); under
`torchrun --nproc-per-node N -m speculators_vllm016 train ...` N processes train data-parallel
(FSDP2 or DDP; NCCL on GPUs, gloo on CPUs). Every input is checked before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.cli.field_flags import add_field_flag
from speculators_vllm016.train.jobs.draft_build import build_model as _build_model
from speculators_vllm016.train.jobs.job_config import (
    JobConfigError,
    TrainJobConfig,
    config_fields,
    load_job_config,
)
from speculators_vllm016.train.jobs.setup import TrainSetup
from speculators_vllm016.train.jobs.setup import prepare as _prepare

if TYPE_CHECKING:
    from speculators_vllm016.models.eagle3 import Eagle3DraftModel

__all__ = [
    "build_model",
    "build_parser",
    "config_from_args",
    "config_from_argv",
    "main",
    "prepare",
    "run_config",
]


def build_parser(
    prog: str = "speculators train", defaults: TrainJobConfig | None = None
) -> argparse.ArgumentParser:
    """The command line of `TrainJobConfig`; `defaults`: the values a `--config` file set."""
    defaults = TrainJobConfig() if defaults is None else defaults
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train an EAGLE-3 draft on hidden states written by `speculators datagen`. "
            "Multi-process: torchrun --nproc-per-node N -m speculators_vllm016 train ..."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a YAML job file with the same fields by section (model:, data:, training:, ...; "
        "as the train_config.yaml written beside the checkpoints); flags given here override it",
    )
    for section in dataclasses.fields(TrainJobConfig):
        values = getattr(defaults, section.name)
        doc = (type(values).__doc__ or section.name).strip()
        group = parser.add_argument_group(f"{section.name}: {doc}")
        for spec in config_fields(type(values)):
            add_field_flag(group, spec, spec.read(values))
    return parser


def config_from_args(
    args: argparse.Namespace, base: TrainJobConfig | None = None
) -> TrainJobConfig:
    """The job config of a parsed command line (`base`: the `--config` file's values)."""
    values = {name: value for name, value in vars(args).items() if name != "config"}
    return (TrainJobConfig() if base is None else base).with_flat(values)


def config_from_argv(
    argv: Sequence[str], prog: str = "speculators train", allow_unknown: bool = False
) -> tuple[TrainJobConfig, list[str]]:
    """`--config`'s file (if any) with the flags of `argv` over it; the flags no field takes
    (an argparse error unless `allow_unknown`). A bad file is a `JobConfigError` naming the key."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(list(argv))
    base = load_job_config(known.config) if known.config else TrainJobConfig()
    parser = build_parser(prog, base)
    if allow_unknown:
        parser.allow_abbrev = False  # a flag of another stage must never be read as a prefix
        args, unknown = parser.parse_known_args(list(argv))
    else:
        args, unknown = parser.parse_args(list(argv)), []
    return config_from_args(args, base), unknown


def _as_config(args: argparse.Namespace | TrainJobConfig) -> TrainJobConfig:
    return args if isinstance(args, TrainJobConfig) else config_from_args(args)


def prepare(args: argparse.Namespace | TrainJobConfig) -> TrainSetup:
    """`train.jobs.setup.prepare` for a parsed command line (or a config), converting a research
    `--from-pretrained` draft as the command does."""
    return _prepare(_as_config(args), research_reader=_research_draft)


def build_model(args: argparse.Namespace | TrainJobConfig, setup: TrainSetup) -> Eagle3DraftModel:
    """`train.jobs.draft_build.build_model` for a parsed command line (or a config)."""
    return _build_model(_as_config(args), setup)


def main(argv: Sequence[str] | None = None, prog: str = "speculators train") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config, _ = config_from_argv(argv, prog)
    except JobConfigError as error:
        from speculators_vllm016.utils.command_errors import EXIT_ERROR, error_line

        print(error_line(str(error)), file=sys.stderr)
        return EXIT_ERROR
    return run_config(config)


def quiet_online_engine(config: TrainJobConfig) -> None:
    """--online starts vLLM, whose dozens of INFO lines would bury training's own: only its
    warnings and errors show unless --verbose (datagen's rule)."""
    if config.online.enabled and not config.logging.verbose:
        from speculators_vllm016.data_generation.vllm_logging import keep_vllm_quiet

        keep_vllm_quiet()


def _research_draft(folder: Path, verifier: str, norm_before_residual: bool) -> tuple[Any, dict]:
    """A research-format `--from-pretrained` draft as `speculators convert` turns it into ours
    (in memory; the training layer cannot import the converter). The fused layers the checkpoint
    records are mapped into our numbering by the mapping of the tool that wrote it
    (`convert/eagle3_sources`), so they are checked against the data's."""
    from speculators_vllm016.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators_vllm016.convert.eagle.utils import load_checkpoint_config
    from speculators_vllm016.convert.eagle3_sources import detect_source

    # A tool whose training fixes the residual placement (TorchSpec, Model Optimizer) gives it;
    # a plain research checkpoint does not record it, and the run's flag stands.
    known = detect_source(load_checkpoint_config(folder)) != "research"
    return Eagle3Converter().build(
        folder, verifier, norm_before_residual=None if known else norm_before_residual
    )


def run_config(config: TrainJobConfig) -> int:
    """Run the job; an expected failure is one line on stderr and exit status 2."""
    quiet_online_engine(config)
    from speculators_vllm016.train.jobs.job import run_train_job
    from speculators_vllm016.train.trainer import TrainingInterrupted
    from speculators_vllm016.utils.command_errors import report_errors
    from speculators_vllm016.utils.errors import SpeculatorsError

    def run() -> int:
        setup = _prepare(config, research_reader=_research_draft)
        run_train_job(config, setup, report=lambda result: print(result.describe()))
        return 0

    # ImportError: an optional package a setting needs (wandb, tensorboard) is not installed.
    expected = (SpeculatorsError, FileNotFoundError, ImportError)
    return report_errors(run, config.logging.debug, expected, stopped=(TrainingInterrupted,))
