"""The chain `speculators gen-and-train` runs: datagen, the vocabulary maps, training.

Layout under the output folder: `data/` (datagen; with `--regenerate` the regenerated
conversations in `data/regenerated/`), `vocab/{d2t,t2d}.npy`, `checkpoints/`.
Each stage keeps the record it has always kept, so folders written by earlier versions resume:
datagen's flags in `data/.datagen_done.json` once it finished (a data folder moved or copied
elsewhere stays done; an unfinished one resumes in datagen itself; a flag the record lacks
counts as its default), the maps' sizes in the maps themselves (kept while they match the flags
and datagen did not run again), and none for training, which always starts and resumes from its
newest checkpoint.

With `--regenerate` the datagen stage is one pass (`run_datagen_regenerating`: one engine load
answers the turns, then extracts them), and its record holds the regeneration flags too. When a
finished one-pass run's flags change (or a plain run follows one), the stage starts over: the
checkpoints, maps and data of the old rows are removed first, so nothing trained on them is
resumed or mixed with the new rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.pipeline.ledgers import DoneFile, NoRecord
from speculators_vllm016.pipeline.runner import (
    Rerun,
    Stage,
    StageEntry,
    StageRunner,
    changed_options,
)
from speculators_vllm016.train.jobs.vocab_size_rule import draft_vocab_too_large
from speculators_vllm016.train.vocab_maps import (
    D2T_FILE,
    T2D_FILE,
    target_vocab_size_of,
    write_vocab_mappings_from_counts,
)
from speculators_vllm016.utils.command_errors import EXIT_STOPPED, report_errors
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.offline import DatagenSummary
    from speculators_vllm016.data_generation.regeneration.options import RegenerateOptions
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig

__all__ = [
    "DATAGEN_DONE",
    "PipelinePlan",
    "STAGES",
    "TrainCommand",
    "check_datagen_flags",
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
    regenerate: RegenerateOptions | None = None
    """`--regenerate`: the target answers the turns first, in datagen's engine load."""
    datagen_defaults: dict[str, Any] = field(default_factory=dict)
    """Datagen's flag defaults, by name: what a record written before a flag existed meant."""

    @property
    def vocab_dir(self) -> Path:
        return self.root / "vocab"


def _datagen_record(flags: Mapping[str, Any]) -> dict:
    # The folder itself is not recorded: a data folder moved or copied elsewhere stays done;
    # nor where the shards ran (the same files either way).
    skip = ("no_progress", "debug", "output_dir", "verbose", "ray_address", "ray_max_retries")
    values = {k: v for k, v in flags.items() if k not in skip}
    return json.loads(json.dumps(values, default=str))


def check_datagen_flags(plan: PipelinePlan) -> None:
    """Before the datagen stage (which may first remove an earlier run): every check of its
    flags and of the target's config that needs no engine."""
    from speculators_vllm016.data_generation.options import DatagenOptions

    options = DatagenOptions.from_args(plan.datagen)
    if plan.regenerate is None:
        options.validate()
        return
    from speculators_vllm016.data_generation.regeneration.one_pass import prepare_one_pass

    prepare_one_pass(options, plan.regenerate)


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


def _own_checkpoints(plan: PipelinePlan) -> Path | None:
    """The checkpoint folder when it lies inside the output folder (the default), apart from
    data/ and vocab/; None where `--save-path` put it elsewhere, which is the user's to clear."""
    checkpoints = Path(plan.train.checkpoint.save_path).resolve()
    root = plan.root.resolve()
    data = Path(plan.datagen.output_dir).resolve()
    holds_the_rest = data.is_relative_to(checkpoints)  # e.g. --save-path is the output folder
    if not checkpoints.is_relative_to(root) or holds_the_rest:
        return None
    return Path(plan.train.checkpoint.save_path)


def _earlier_run_files(plan: PipelinePlan, data: Path) -> tuple[Path, ...]:
    """What a changed one-pass run removes: the checkpoints and maps made from the old rows,
    then the data folder, its record last (a crash midway keeps the record, so the next call
    removes the rest)."""
    done = data / DATAGEN_DONE
    checkpoints = _own_checkpoints(plan)
    files = ([] if checkpoints is None else [checkpoints]) + [plan.vocab_dir]
    if data.is_dir():
        files += sorted(path for path in data.iterdir() if path != done)
    return (*files, done)


def _refuse_checkpoints_elsewhere(plan: PipelinePlan) -> None:
    """Checkpoints that are not the output folder's own (`--save-path`) are not removed: a
    changed run is refused while that folder holds anything."""
    checkpoints = Path(plan.train.checkpoint.save_path)
    if _own_checkpoints(plan) is None and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise InvalidInputError(
            f"--save-path {checkpoints} holds checkpoints trained on the earlier run's data; "
            "remove them or choose another --save-path"
        )


def datagen_stage(plan: PipelinePlan) -> Stage[DatagenSummary]:
    """Datagen into `data/` (one pass with regeneration under `--regenerate`), skipped while its
    record says the same flags finished there."""
    data = Path(plan.datagen.output_dir)
    ledger = DoneFile(data / DATAGEN_DONE, defaults=_datagen_record(plan.datagen_defaults))
    earlier = ledger.read("datagen")
    regenerated_earlier = earlier is not None and bool((earlier.options or {}).get("regenerate"))
    # A regenerated folder holds a regeneration job that refuses other flags, and its rows
    # must not mix with others: a changed one-pass run starts over.
    starts_over = plan.regenerate is not None or regenerated_earlier
    what = "regeneration + datagen" if plan.regenerate is not None else "datagen"

    def run() -> DatagenSummary:
        from speculators_vllm016.data_generation.offline import run_datagen
        from speculators_vllm016.data_generation.options import DatagenOptions
        from speculators_vllm016.data_generation.vllm_logging import keep_vllm_quiet

        unfinished = earlier is None and data.is_dir() and any(data.iterdir())
        note = " (resuming the unfinished run there)" if unfinished else ""
        print(f"{_step('datagen')} {what} -> {data}{note}")
        if not getattr(plan.datagen, "verbose", False):
            keep_vllm_quiet()
        options = DatagenOptions.from_args(plan.datagen)
        ray_address = getattr(plan.datagen, "ray_address", None)
        if ray_address is not None:  # every shard as a Ray task; the folder then holds them all
            from speculators_vllm016.data_generation.ray_shards import run_shards_on_ray

            summary = run_shards_on_ray(
                options,
                ray_address,
                plan.datagen.ray_max_retries,
                verbose=getattr(plan.datagen, "verbose", False),
            )
        elif plan.regenerate is None:
            summary = run_datagen(options)
        else:
            from speculators_vllm016.data_generation.regeneration.one_pass import (
                run_datagen_regenerating,
            )

            regenerated, summary = run_datagen_regenerating(options, plan.regenerate)
            print(f"      regenerated: {regenerated.describe()}")
        print(f"      {summary.describe()}")
        return summary

    def rerun(why: Rerun) -> None:
        if not starts_over:
            return  # plain datagen resumes or refuses its folder itself
        _refuse_checkpoints_elsewhere(plan)
        print(
            f"{_step('datagen')} {what}: the flags differ from the finished run's "
            f"({changed_options(why.before, why.now)}); removing its data, maps and "
            "checkpoints and starting over"
        )

    return Stage(
        name="datagen",
        run=run,
        ledger=ledger,
        options=_datagen_record(vars(plan.datagen)),
        clear_on_change=_earlier_run_files(plan, data) if starts_over else (),
        on_reuse=lambda _: print(f"{_step('datagen')} {what}: done earlier in {data}"),
        on_rerun=rerun,
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
        check_datagen_flags(plan)
        runner.run(datagen_stage(plan))
        runner.run(vocab_stage(plan))
        return 0

    def data_stages_until_stopped() -> int:
        from speculators_vllm016.data_generation.ray_shards import StopRequested

        try:
            return data_stages()
        except StopRequested as stop:  # SIGTERM while Ray shards ran: they resume on a rerun
            print(f"stopped: {stop}", file=sys.stderr)
            return EXIT_STOPPED

    status = report_errors(data_stages_until_stopped, plan.debug)
    if status != 0:
        return status
    return runner.run(train_stage(plan, train)).output or 0
