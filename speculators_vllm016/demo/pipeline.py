"""The demo's stages, from a random tiny Llama to measured trained drafts.

1. split: the shipped conversations cut into the target's, the drafts' and held-out rows
   (`demo.held_out`);
2. target: the tiny Llama trained briefly on its rows (`demo.target`);
3. datagen: its hidden states for the drafts' conversations (`data_generation.offline.run_datagen`);
4. vocab: the draft vocabulary maps from datagen's token counts (`train.vocab_maps`);
5. draft: the draft with its initial weights, built by the trainer's own construction
   (`train.jobs.setup`, `train.jobs.draft_build`);
6. train: the job `speculators train` runs (`train.jobs.job.run_train_job`, in this process), from
   a `TrainJobConfig`;
7. regen datagen, regen vocab, regen train: the same conversations with every answer regenerated
   by the target (greedy), extracted on the same engine load
   (`data_generation.regeneration.one_pass`), then maps and a draft of their own, trained with
   the same options (skipped with `regenerate=False`);
8. eval: the drafts with `evaluate.runner.run_evaluation` (hf engine) on the held-out rows;
9. serve: vLLM 0.16 serves those prompts with each trained draft and without
   (`demo.serving`): its own acceptance counters beside eval's, outputs compared, tokens/s
   (skipped with `serve=False`).

Each stage records in `<output>/demo_state.json` the options it depends on (its own and those of
the stages it reads from) when it starts, and its result once it finished. A rerun reuses a
finished stage whose options are unchanged; a stage whose options changed (so every stage that
reads it too) runs again from scratch, its old outputs removed. A stage interrupted with the
same options resumes (datagen, regeneration, training and the target resume on their own after a
crash). The stages run on `pipeline.runner` with the `pipeline.ledgers.StateFile` ledger; a new
stage is its options in `stage_options` and its work in `_STAGES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from speculators_vllm016.demo.options import DemoOptions
from speculators_vllm016.pipeline.ledgers import StateFile
from speculators_vllm016.pipeline.runner import Rerun, Stage, StageRunner, changed_options
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "REGENERATION_STAGES",
    "DemoResult",
    "StageRecord",
    "run_demo",
    "stage_options",
]

STATE_FILE = "demo_state.json"


@dataclass
class StageRecord:
    name: str
    seconds: float
    outputs: dict[str, str]
    figures: dict[str, Any] = field(default_factory=dict)
    reused: bool = False


@dataclass
class StageOutputs:
    """What a stage's work returns, kept in `demo_state.json`: where it wrote, what it measured."""

    outputs: dict[str, str]
    figures: dict[str, Any]


@dataclass
class DemoResult:
    root: Path
    stages: list[StageRecord]

    def stage(self, name: str) -> StageRecord:
        return next(s for s in self.stages if s.name == name)


def _load_state(root: Path) -> StateFile:
    """The demo's record of its stages (`demo_state.json`; none yet: an empty one)."""
    return StateFile(root / STATE_FILE)


_NEEDS: dict[str, tuple[str, ...]] = {
    "split": (),
    "target": ("split",),
    "datagen": ("target",),
    "vocab": ("datagen",),
    "initial draft": ("vocab",),
    "train": ("initial draft",),
    "regen datagen": ("datagen",),
    "regen vocab": ("regen datagen", "vocab"),
    "regen train": ("regen vocab", "train"),
    "eval": ("train", "regen train"),
    "serve": ("eval",),
}
"""The stages each stage reads from (regen vocab takes the vocabulary size, regen train the
training options, of the shipped draft's stages), in the order the stages run."""

REGENERATION_STAGES = ("regen datagen", "regen vocab", "regen train")


def stage_options(options: DemoOptions) -> dict[str, dict[str, Any]]:
    """Per stage, in order, the options its result depends on: its own and those of every stage
    it reads from (a changed target invalidates the hidden states, the maps, the drafts and the
    evaluation; the regeneration's options only the regenerated draft and the evaluation).
    Without `regenerate` the regeneration stages are left out."""
    own: dict[str, dict[str, Any]] = {
        "split": {"held_out_every": options.held_out_every, "max_samples": options.max_samples},
        "target": {
            "seed": options.seed,
            "target_steps": options.target_steps,
            "target_row_tokens": options.target_row_tokens,
            "target_rows_per_step": options.target_rows_per_step,
            "target_long_row_tokens": options.target_long_row_tokens,
            "target_long_every": options.target_long_every,
        },
        "datagen": {
            "seq_length": options.seq_length,
            "batch_size": options.batch_size,
            "output_format": options.output_format,
            "dtype": options.dtype,
        },
        "vocab": {"draft_vocab_size": options.draft_vocab_size},
        "initial draft": {},
        "train": {
            "epochs": options.epochs,
            "lr": options.lr,
            "total_seq_len": options.total_seq_len,
            "sliding_window": options.sliding_window,
        },
        "regen datagen": {"regenerate_max_tokens": options.regenerate_max_tokens},
        "regen vocab": {},
        "regen train": {},
        "eval": {
            "eval_prompts": options.eval_prompts,
            "max_new_tokens": options.max_new_tokens,
            "regenerate": options.regenerate,
        },
        "serve": {"serve": options.serve, "long_context": options.long_context},
    }
    result: dict[str, dict[str, Any]] = {}
    for name, needs in _NEEDS.items():
        if name in REGENERATION_STAGES and not options.regenerate:
            continue
        if name == "serve" and not options.serve:
            continue
        merged: dict[str, Any] = {}
        for need in needs:
            merged.update(result.get(need, {}))
        result[name] = {**merged, **own[name]}
    return result


def _say_rerun(name: str) -> Callable[[Rerun], None]:
    def say(why: Rerun) -> None:
        print(f"[demo] {name}: running it again ({changed_options(why.before, why.now)})")

    return say


def _run_stage(
    root: Path,
    state: StateFile,
    name: str,
    work: Callable[[], tuple[dict, dict]],
    options: dict[str, Any] | None = None,
    outputs: Sequence[Path] = (),
) -> StageRecord:
    """Run `work` (returning its output paths and figures) unless `state` records that it
    finished with the same `options`.

    `options`: everything the stage's result depends on (JSON values). When a record of the stage
    with other options exists, its `outputs` (files or folders, inside `root`) are removed first,
    so nothing of the old run is resumed or reused.
    """
    outside = [path for path in outputs if not Path(path).resolve().is_relative_to(root.resolve())]
    if outside:
        raise ValueError(f"demo stage {name!r} would remove {outside[0]}, outside {root}")
    outcome = StageRunner().run(
        Stage(
            name=name,
            run=lambda: StageOutputs(*work()),
            ledger=state,
            options=options or {},
            clear_on_change=tuple(outputs),
            output_type=StageOutputs,
            on_rerun=_say_rerun(name),
        )
    )
    done = outcome.output or StageOutputs(outputs={}, figures={})
    return StageRecord(
        name=name,
        seconds=outcome.seconds,
        outputs=done.outputs,
        figures=done.figures,
        reused=outcome.reused,
    )


def _check_long_context(options: DemoOptions) -> None:
    """Refuse, in one line naming the flag, long prompts the target cannot hold with their answers
    and a window no draft step can see through (before anything is written)."""
    from speculators_vllm016.demo import MAX_POSITIONS

    room = MAX_POSITIONS - options.max_new_tokens
    if not 0 <= options.long_context <= room:
        raise InvalidInputError(
            f"--long-context must be between 0 and {room} (the target's {MAX_POSITIONS} positions "
            f"less --max-new-tokens {options.max_new_tokens}), got {options.long_context}"
        )
    if options.sliding_window is not None and options.sliding_window < 3:
        raise InvalidInputError(
            f"--sliding-window must be 0 (full attention) or at least the 3 tokens a draft "
            f"proposes, got {options.sliding_window}"
        )


def _check_target_rows(options: DemoOptions) -> None:
    """Refuse, in one line naming the flag, long target rows past the target's positions or a
    step rhythm that never comes (before anything is written)."""
    from speculators_vllm016.demo import MAX_POSITIONS

    if not 0 <= options.target_long_row_tokens <= MAX_POSITIONS:
        raise InvalidInputError(
            f"--target-long-row-tokens must be between 0 and the target's {MAX_POSITIONS} "
            f"positions, got {options.target_long_row_tokens}"
        )
    if options.target_long_row_tokens and options.target_long_every < 1:
        raise InvalidInputError(
            f"--target-long-every must be at least 1, got {options.target_long_every}"
        )


def run_demo(options: DemoOptions) -> DemoResult:
    """Run (or resume) every stage; returns what each stage wrote and measured."""
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.engine_dtype import choose_engine_dtype
    from speculators_vllm016.demo.held_out import check_every, check_split, split_of_file
    from speculators_vllm016.demo.stages import STAGES, DemoRun

    conversations = demo_conversations_path()
    check_every(options.held_out_every)
    _, split = split_of_file(conversations, options.held_out_every, options.max_samples)
    check_split(split, options.max_samples, options.eval_prompts)
    if options.regenerate_max_tokens < 1:
        raise InvalidInputError(
            f"--regenerate-max-tokens must be at least 1, got {options.regenerate_max_tokens}"
        )
    _check_long_context(options)
    _check_target_rows(options)
    dtype, why = choose_engine_dtype(options.dtype)
    if why is not None:
        print(why)
    options = replace(options, dtype=dtype)  # the stages record the dtype that ran
    root = Path(options.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = _load_state(root)
    run = DemoRun(options=options, root=root, conversations=conversations)
    stages = [
        _run_stage(root, state, name, partial(work, run), depends, clear(run))
        for name, depends in stage_options(options).items()
        for work, clear in [STAGES[name]]
    ]
    return DemoResult(root=root, stages=stages)
