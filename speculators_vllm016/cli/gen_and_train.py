"""`speculators gen-and-train`: datagen, vocabulary maps and draft training in one resumable command.

The successor of 0.3.0's `scripts/gen_and_train.py`. Its own flags name the job and its folder;
every other flag belongs to `speculators datagen` or `speculators train` and is handed to that
stage unchanged. Layout under --output-dir: `data/` (datagen), `vocab/{d2t,t2d}.npy`,
`checkpoints/` (training). Run the same command again after a crash: datagen computes only missing
samples, the maps are kept while their sizes match the flags, and training resumes from its newest
checkpoint, ending bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from speculators_vllm016.train.jobs.job_config import JobConfigError, TrainJobConfig
from speculators_vllm016.train.jobs.vocab_size_rule import draft_vocab_too_large
from speculators_vllm016.train.vocab_maps import (
    D2T_FILE,
    T2D_FILE,
    target_vocab_size_of,
    write_vocab_mappings_from_counts,
)
from speculators_vllm016.utils.atomic_files import atomic_write_text
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["PipelinePlan", "build_parser", "main", "plan_from_argv"]

DATAGEN_DONE = ".datagen_done.json"  # in data/: the datagen flags of the finished run


def build_parser(prog: str = "speculators gen-and-train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Generate hidden states, build the draft vocabulary maps and train an EAGLE-3 draft, "
            "each stage resumable. Any other flag of `speculators datagen --help` or "
            "`speculators train --help` is passed to that stage."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
        allow_abbrev=False,
    )
    parser.add_argument(
        "-h", "--help", action="store_true", help="show this help and the stages' flags"
    )
    parser.add_argument(
        "--target-model-path", help="the target (verifier) model: hub id or local folder"
    )
    parser.add_argument("--train-data-path", help="chat data, as for datagen")
    parser.add_argument("--output-dir", help="folder for data/, vocab/ and checkpoints/")
    parser.add_argument(
        "--draft-vocab-size", type=int, default=32000, help="tokens the draft predicts"
    )
    parser.add_argument(
        "--target-vocab-size",
        type=int,
        default=None,
        help="target vocabulary size; None: from the target's config",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of datagen's shuffle and of training"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


@dataclass
class PipelinePlan:
    """The three stages' settings, as their own command lines read them."""

    root: Path
    datagen: argparse.Namespace
    datagen_argv: list[str]
    train: TrainJobConfig
    """The training job (`speculators train`'s flags and `--config` file, the layout set)."""
    draft_vocab_size: int
    target_vocab_size: int | None
    debug: bool

    @property
    def vocab_dir(self) -> Path:
        return self.root / "vocab"


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.allow_abbrev = False  # a train flag must never be read as a prefix of a datagen flag
    return parser


def plan_from_argv(argv: Sequence[str]) -> PipelinePlan:
    """Split the command line among the stages; an unknown flag is an error naming it."""
    from speculators_vllm016.cli import datagen as datagen_cli
    from speculators_vllm016.cli import train as train_cli

    own, rest = build_parser().parse_known_args(list(argv))
    missing = [
        f for f in ("target_model_path", "train_data_path", "output_dir") if not getattr(own, f)
    ]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise SystemExit(f"error: gen-and-train needs {flags} (see --help)")
    if own.draft_vocab_size < 1:
        raise SystemExit(
            f"error: --draft-vocab-size must be at least 1, got {own.draft_vocab_size}"
        )
    if own.target_vocab_size is not None and own.target_vocab_size < own.draft_vocab_size:
        raise SystemExit(
            f"error: {draft_vocab_too_large(own.draft_vocab_size, own.target_vocab_size)}"
        )
    root = Path(own.output_dir)
    shared = ["--seed", str(own.seed)] + (["--no-progress"] if own.no_progress else [])
    shared += ["--debug"] if own.debug else []
    for flag in (
        "--output-dir",
        "--data-path",
        "--verifier-name-or-path",
        "--d2t-path",
        "--t2d-path",
    ):
        if flag in rest:
            raise SystemExit(
                f"error: {flag} is set by gen-and-train from --output-dir/--target-model-path"
            )
    datagen_argv = [
        "--target-model-path",
        own.target_model_path,
        "--train-data-path",
        own.train_data_path,
        "--output-dir",
        str(root / "data"),
        *shared,
    ]
    datagen_args, rest = _strict(datagen_cli.build_parser()).parse_known_args(datagen_argv + rest)
    train_argv = [
        "--verifier-name-or-path",
        own.target_model_path,
        "--data-path",
        str(root / "data"),
        "--d2t-path",
        str(root / "vocab" / "d2t.npy"),
        "--t2d-path",
        str(root / "vocab" / "t2d.npy"),
        "--save-path",
        str(root / "checkpoints"),
        *shared,
    ]
    # --save-path may be given to put checkpoints elsewhere; a later value wins in argparse.
    try:
        train_config, unknown = train_cli.config_from_argv(train_argv + rest, allow_unknown=True)
    except JobConfigError as error:
        raise SystemExit(f"error: {error}") from None
    if unknown:
        raise SystemExit(
            f"error: unknown flag(s) {' '.join(unknown)}: not a flag of gen-and-train, "
            "datagen or train (see --help)"
        )
    return PipelinePlan(
        root=root,
        datagen=datagen_args,
        datagen_argv=sorted(datagen_argv + list(rest)),
        train=train_config,
        draft_vocab_size=own.draft_vocab_size,
        target_vocab_size=own.target_vocab_size,
        debug=own.debug,
    )


def _datagen_record(plan: PipelinePlan) -> dict:
    # The folder itself is not recorded: a data folder moved or copied elsewhere stays done.
    skip = ("no_progress", "debug", "output_dir", "verbose")
    values = {k: v for k, v in vars(plan.datagen).items() if k not in skip}
    return json.loads(json.dumps(values, default=str))


def check_vocab_sizes(plan: PipelinePlan) -> None:
    """Before datagen (hours): the draft vocabulary must fit the target's, when that is known.

    An unreadable target config is left to datagen, which reports it in its own words.
    """
    if plan.target_vocab_size is not None:
        return  # compared with --draft-vocab-size when the flags were read
    try:
        size = target_vocab_size_of(plan.datagen.target_model_path)
    except Exception:  # noqa: BLE001 - datagen reports an unusable target itself
        return
    if plan.draft_vocab_size > size:
        raise InvalidInputError(draft_vocab_too_large(plan.draft_vocab_size, size))


def run_datagen_stage(plan: PipelinePlan) -> bool:
    """Datagen, skipped when this folder's record says the same flags already finished.

    Returns whether it ran (its token counts may have changed)."""
    from speculators_vllm016.cli.datagen import keep_vllm_quiet, options_from_args
    from speculators_vllm016.data_generation.offline import run_datagen

    data = Path(plan.datagen.output_dir)
    done = data / DATAGEN_DONE
    record = _datagen_record(plan)
    if done.is_file() and json.loads(done.read_text()) == record:
        print(f"[1/3] datagen: done earlier in {data}")
        return False
    print(f"[1/3] datagen -> {data}")
    if not getattr(plan.datagen, "verbose", False):
        keep_vllm_quiet()
    summary = run_datagen(options_from_args(plan.datagen))
    print(f"      {summary.describe()}")
    atomic_write_text(done, json.dumps(record, indent=2) + "\n")
    return True


def _map_sizes(folder: Path) -> tuple[int, int] | None:
    """(draft, target) entries of the maps in `folder`, or None when either is missing or unreadable."""
    import numpy as np

    try:
        d2t = np.load(folder / D2T_FILE, mmap_mode="r")
        t2d = np.load(folder / T2D_FILE, mmap_mode="r")
    except (OSError, ValueError):
        return None
    return (len(d2t), len(t2d)) if d2t.ndim == 1 and t2d.ndim == 1 else None


def run_vocab_stage(plan: PipelinePlan, data_changed: bool = False) -> None:
    """The maps from datagen's token counts; kept while they have the sizes the flags ask for
    and datagen did not run again (new token counts)."""
    from speculators_vllm016.data_generation.token_counts import load_token_freq

    folder = plan.vocab_dir
    size = plan.target_vocab_size or target_vocab_size_of(plan.datagen.target_model_path)
    found = _map_sizes(folder)
    if found == (plan.draft_vocab_size, size) and not data_changed:
        print(f"[2/3] vocabulary maps: done earlier in {folder}")
        return
    if found is not None:
        why = (
            "datagen ran again"
            if found == (plan.draft_vocab_size, size)
            else f"they map {found[0]} of {found[1]} tokens, the flags ask "
            f"{plan.draft_vocab_size} of {size}"
        )
        print(f"[2/3] vocabulary maps in {folder}: building them again ({why})")
    counts = load_token_freq(plan.datagen.output_dir)
    write_vocab_mappings_from_counts(counts, plan.draft_vocab_size, size, folder)
    print(f"[2/3] vocabulary maps: {plan.draft_vocab_size} of {size} tokens -> {folder}")


def main(argv: Sequence[str] | None = None, prog: str = "speculators gen-and-train") -> int:
    from speculators_vllm016.cli import datagen as datagen_cli
    from speculators_vllm016.cli import train as train_cli
    from speculators_vllm016.utils.command_errors import error_line, report_errors

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser(prog).print_help()
        print(
            "\n--- datagen stage (flags other than --target-model-path/--train-data-path/--output-dir) ---"
        )
        datagen_cli.build_parser().print_help()
        print("\n--- training stage (data, maps and --save-path are set from --output-dir) ---")
        train_cli.build_parser().print_help()
        return 0
    try:
        plan = plan_from_argv(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(error_line(stop.code.removeprefix("error: ")), file=sys.stderr)
            return 2
        return int(stop.code or 0)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def stages() -> int:
        check_vocab_sizes(plan)
        data_changed = run_datagen_stage(plan)
        run_vocab_stage(plan, data_changed)
        return 0

    rc = report_errors(stages, plan.debug)
    if rc != 0:
        return rc
    print(f"[3/3] training -> {plan.train.checkpoint.save_path}")
    return train_cli.run_config(plan.train)
