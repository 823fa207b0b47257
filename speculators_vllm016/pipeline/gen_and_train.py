"""The chain `speculators gen-and-train` runs: datagen, the vocabulary maps, training.

Layout under the output folder: `data/` (datagen), `vocab/{d2t,t2d}.npy`, `checkpoints/`.
Each stage keeps the record it has always kept, so folders written by earlier versions resume:
datagen's flags in `data/.datagen_done.json` once it finished (a data folder moved or copied
elsewhere stays done; an unfinished one resumes in datagen itself), the maps' sizes in the maps
themselves (kept while they match the flags and datagen did not run again), and none for
training, which always starts and resumes from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.pipeline.ledgers import DoneFile, NoRecord
from speculators_vllm016.pipeline.runner import Rerun, Stage, StageEntry, StageRunner
from speculators_vllm016.train.jobs.vocab_size_rule import draft_vocab_too_large
from speculators_vllm016.train.vocab_maps import (
    D2T_FILE,
    T2D_FILE,
    target_vocab_size_of,
    write_vocab_mappings_from_counts,
)
from speculators_vllm016.utils.command_errors import report_errors
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.offline import DatagenSummary
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig

__all__ = [
    "DATAGEN_DONE",
    "PipelinePlan",
    "STAGES",
    "TrainCommand",
    "check_vocab_sizes",
    "datagen_stage",
    "run_datagen_stage",
    "run_gen_and_train",
    "run_vocab_stage",
    "train_stage",
    "vocab_stage",
]

DATAGEN_DONE = ".datagen_done.json"  # in data/: the datagen flags of the finished run

STAGES = ("datagen", "vocab", "train")
"""The chain's stages in order; each is made by `<name>_stage(plan, ...)` and numbered from here
in what it prints. A new stage: its name here, its `Stage` maker, a call in `run_gen_and_train`,
and `after=(...)` on the stages that read what it writes."""


def _step(name: str) -> str:
    """`[i/n]`: where the stage stands in the chain, for the lines it prints."""
    return f"[{STAGES.index(name) + 1}/{len(STAGES)}]"


TrainCommand = Callable[["TrainJobConfig"], int]
"""Runs a training job as `speculators train` does (its errors reported); the exit status."""


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


def datagen_stage(plan: PipelinePlan) -> Stage[DatagenSummary]:
    """Datagen into `data/`, skipped while its record says the same flags finished there."""
    data = Path(plan.datagen.output_dir)

    def run() -> DatagenSummary:
        from speculators_vllm016.data_generation.offline import run_datagen
        from speculators_vllm016.data_generation.options import DatagenOptions
        from speculators_vllm016.data_generation.vllm_logging import keep_vllm_quiet

        print(f"{_step('datagen')} datagen -> {data}")
        if not getattr(plan.datagen, "verbose", False):
            keep_vllm_quiet()
        summary = run_datagen(DatagenOptions.from_args(plan.datagen))
        print(f"      {summary.describe()}")
        return summary

    return Stage(
        name="datagen",
        run=run,
        ledger=DoneFile(data / DATAGEN_DONE),
        options=_datagen_record(plan),
        on_reuse=lambda _: print(f"{_step('datagen')} datagen: done earlier in {data}"),
    )


class VocabMapSizes:
    """The maps' record is the maps: the sizes of `d2t.npy` and `t2d.npy` in the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def read(self, name: str) -> StageEntry | None:
        import numpy as np

        try:
            d2t = np.load(self.folder / D2T_FILE, mmap_mode="r")
            t2d = np.load(self.folder / T2D_FILE, mmap_mode="r")
        except (OSError, ValueError):
            return None  # missing or unreadable: built again
        if d2t.ndim != 1 or t2d.ndim != 1:
            return None
        sizes = {"draft_vocab_size": len(d2t), "target_vocab_size": len(t2d)}
        return StageEntry(options=sizes, finished=True)

    def started(self, name: str, options: dict[str, Any]) -> None:
        pass

    def finished(self, name: str, options: dict[str, Any], seconds: float, output: Any) -> None:
        pass  # the maps are written atomically by the stage itself


def vocab_stage(plan: PipelinePlan) -> Stage[tuple[Path, Path]]:
    """The maps from datagen's token counts; kept while they have the sizes the flags ask for
    and datagen did not run again (new token counts)."""
    from speculators_vllm016.data_generation.token_counts import load_token_freq

    folder = plan.vocab_dir
    size = plan.target_vocab_size or target_vocab_size_of(plan.datagen.target_model_path)

    def rerun(why: Rerun) -> None:
        if not why.options_changed:
            reason = "datagen ran again"
        else:
            found = why.before or {}
            reason = (
                f"they map {found['draft_vocab_size']} of {found['target_vocab_size']} tokens, "
                f"the flags ask {plan.draft_vocab_size} of {size}"
            )
        print(f"{_step('vocab')} vocabulary maps in {folder}: building them again ({reason})")

    def run() -> tuple[Path, Path]:
        counts = load_token_freq(plan.datagen.output_dir)
        maps = write_vocab_mappings_from_counts(counts, plan.draft_vocab_size, size, folder)
        print(
            f"{_step('vocab')} vocabulary maps: {plan.draft_vocab_size} of {size} tokens -> {folder}"
        )
        return maps

    return Stage(
        name="vocab",
        run=run,
        ledger=VocabMapSizes(folder),
        options={"draft_vocab_size": plan.draft_vocab_size, "target_vocab_size": size},
        after=("datagen",),
        on_reuse=lambda _: print(f"{_step('vocab')} vocabulary maps: done earlier in {folder}"),
        on_rerun=rerun,
    )


def train_stage(plan: PipelinePlan, train: TrainCommand) -> Stage[int]:
    """Training always starts: the job itself resumes from its newest checkpoint."""

    def run() -> int:
        print(f"{_step('train')} training -> {plan.train.checkpoint.save_path}")
        return train(plan.train)

    return Stage(name="train", run=run, ledger=NoRecord())


def run_datagen_stage(plan: PipelinePlan, runner: StageRunner | None = None) -> bool:
    """Datagen unless done earlier with the same flags; whether it ran (new token counts)."""
    return not (runner or StageRunner()).run(datagen_stage(plan)).reused


def run_vocab_stage(plan: PipelinePlan, data_changed: bool = False) -> None:
    """The maps alone (`data_changed`: datagen ran in this call, so they are built again)."""
    StageRunner(ran={"datagen"} if data_changed else None).run(vocab_stage(plan))


def run_gen_and_train(plan: PipelinePlan, train: TrainCommand) -> int:
    """Every stage in order; the exit status (an expected failure before training: one line, 2)."""
    runner = StageRunner()

    def data_stages() -> int:
        check_vocab_sizes(plan)
        runner.run(datagen_stage(plan))
        runner.run(vocab_stage(plan))
        return 0

    status = report_errors(data_stages, plan.debug)
    if status != 0:
        return status
    return runner.run(train_stage(plan, train)).output or 0
