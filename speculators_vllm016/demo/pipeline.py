"""The demo's stages, from a random tiny Llama to a measured trained draft.

1. target: the tiny Llama trained briefly on the shipped conversations (`demo.target`);
2. datagen: its hidden states for the conversations (`data_generation.offline.run_datagen`);
3. vocab: the draft vocabulary maps from datagen's token counts (`train.vocab_maps`);
4. draft: the draft with its initial weights, built by the trainer's own construction
   (`train.jobs.setup`, `train.jobs.draft_build`);
5. train: the job `speculators train` runs (`train.jobs.job.run_train_job`, in this process), from
   a `TrainJobConfig`;
6. eval: both drafts with `evaluate.runner.run_evaluation` (hf engine), side by side.

Each stage records in `<output>/demo_state.json` the options it depends on (its own and those of
the stages before it) when it starts, and its result once it finished. A rerun reuses a finished
stage whose options are unchanged; a stage whose options changed (so every stage after it too)
runs again from scratch, its old outputs removed. A stage interrupted with the same options
resumes (datagen, training and the target resume on their own after a crash). The stages run
on `pipeline.runner` with the `pipeline.ledgers.StateFile` ledger; a new stage is its options in
`stage_options` and its work in `_STAGES`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.pipeline.ledgers import StateFile
from speculators_vllm016.pipeline.runner import Rerun, Stage, StageRunner, changed_options
from speculators_vllm016.utils.atomic_files import atomic_write, give_usual_modes, replace_folder

if TYPE_CHECKING:
    from speculators_vllm016.train.jobs.job_config import TrainJobConfig

__all__ = [
    "DemoOptions",
    "DemoResult",
    "StageRecord",
    "plot_training_curves",
    "run_demo",
    "stage_options",
    "training_throughput",
]

STATE_FILE = "demo_state.json"


@dataclass
class DemoOptions:
    output_dir: str = "output/demo"
    max_samples: int | None = 160
    seq_length: int = 1024
    batch_size: int = 128
    output_format: str = "pt"
    target_steps: int = 40
    target_row_tokens: int = 128
    target_rows_per_step: int = 8
    draft_vocab_size: int = 512
    epochs: int = 2
    lr: float = 1e-3
    total_seq_len: int = 2048
    eval_prompts: int = 24
    max_new_tokens: int = 32
    seed: int = 0
    dtype: str = "auto"
    """The extraction engine's dtype; "auto" is resolved by `demo.engine_dtype` when the run starts."""
    show_progress: bool = True


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


def stage_options(options: DemoOptions) -> dict[str, dict[str, Any]]:
    """Per stage, in order, the options its result depends on: its own and every earlier stage's
    (a changed target invalidates the hidden states, the maps, the drafts and the evaluation)."""
    own = {
        "target": {
            "seed": options.seed,
            "target_steps": options.target_steps,
            "target_row_tokens": options.target_row_tokens,
            "target_rows_per_step": options.target_rows_per_step,
        },
        "datagen": {
            "max_samples": options.max_samples,
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
        },
        "eval": {"eval_prompts": options.eval_prompts, "max_new_tokens": options.max_new_tokens},
    }
    cumulative: dict[str, Any] = {}
    result = {}
    for name, values in own.items():
        cumulative = {**cumulative, **values}
        result[name] = cumulative
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


def _train_config(options: DemoOptions, root: Path, target: Path) -> TrainJobConfig:
    """The draft's training job: the demo's folders, its options, the CPU in this process."""
    from speculators_vllm016.train.jobs.job_config import (
        CheckpointConfig,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        RuntimeConfig,
        TrainingConfig,
        TrainJobConfig,
        VocabConfig,
    )
    from speculators_vllm016.train.vocab_maps import D2T_FILE, T2D_FILE

    return TrainJobConfig(
        model=ModelConfig(verifier_name_or_path=str(target)),
        data=DataConfig(data_path=str(root / "data")),
        vocab=VocabConfig(
            d2t_path=str(root / "vocab" / D2T_FILE), t2d_path=str(root / "vocab" / T2D_FILE)
        ),
        checkpoint=CheckpointConfig(save_path=str(root / "checkpoints")),
        training=TrainingConfig(
            epochs=options.epochs,
            lr=options.lr,
            total_seq_len=options.total_seq_len,
            seed=options.seed,
        ),
        runtime=RuntimeConfig(num_workers=0, device="cpu"),
        logging=LoggingConfig(log_dir=str(root / "logs"), no_progress=not options.show_progress),
    )


def _save_initial_draft(config: TrainJobConfig, output: Path) -> None:
    """The draft exactly as training starts from it (the trainer's construction and seed)."""
    import torch

    from speculators_vllm016.train.checkpointer import convert_float_dtype
    from speculators_vllm016.train.jobs.draft_build import build_model
    from speculators_vllm016.train.jobs.setup import prepare

    model = build_model(config, prepare(config))
    temporary = output.with_name(f".{output.name}.partial")
    shutil.rmtree(temporary, ignore_errors=True)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    model.save_pretrained(
        temporary, state_dict=convert_float_dtype(weights, torch.bfloat16), safe_serialization=True
    )
    give_usual_modes(temporary)
    replace_folder(temporary, output)


def read_training_metrics(path: Path) -> list[dict]:
    """The train lines of the trainer's metrics.jsonl: `{"step", "loss", "full_acc_0", "tokens"}`."""
    from speculators_vllm016.train.metrics_log import read_train_steps

    return read_train_steps(path)


def training_throughput(metrics: list[dict], call_seconds: float) -> tuple[int, float]:
    """All trained tokens, and tokens per second of the steps that trained them.

    A resumed training call logs only its own steps, but metrics.jsonl holds every step of the
    run (the interrupted call's too): the rate divides the tokens by the steps' own
    `step_seconds`, never by the time of the last call. Lines without `step_seconds` (a trainer
    that does not log it) fall back to `call_seconds`.
    """
    tokens = int(sum(m.get("tokens", 0) for m in metrics))
    timed = [m for m in metrics if isinstance(m.get("step_seconds"), (int, float))]
    if metrics and len(timed) == len(metrics):
        seconds = sum(m["step_seconds"] for m in timed)
    else:
        seconds = call_seconds
    return tokens, tokens / seconds if seconds > 0 else 0.0


def plot_training_curves(metrics: list[dict], path: Path) -> None:
    """A PNG of the draft's training loss and first-position accuracy per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    figure, (loss_axes, acc_axes) = plt.subplots(1, 2, figsize=(9.6, 3.6), dpi=100)
    loss_axes.plot(steps, [m.get("loss") for m in metrics], color="tab:red")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("training loss")
    acc_axes.plot(steps, [m.get("full_acc_0") for m in metrics], color="tab:blue")
    acc_axes.set_xlabel("step")
    acc_axes.set_ylabel("full_acc_0 (first draft token)")
    acc_axes.set_ylim(0.0, 1.0)
    for axes in (loss_axes, acc_axes):
        axes.grid(alpha=0.3)
    figure.suptitle("Draft training (speculators demo)")
    figure.tight_layout()
    try:
        atomic_write(path, lambda handle: figure.savefig(handle, format="png"))
    finally:
        plt.close(figure)


@dataclass(frozen=True)
class _DemoRun:
    """What every stage of one demo run reads: its options and where things go."""

    options: DemoOptions
    root: Path
    conversations: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def untrained(self) -> Path:
        return self.root / "draft-untrained"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def trained(self) -> Path:
        return self.checkpoints / str(self.options.epochs - 1)

    def train_config(self) -> TrainJobConfig:
        return _train_config(self.options, self.root, self.target)


def _target_stage(run: _DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.demo import build_demo_model
    from speculators_vllm016.demo.target import TargetTraining, train_demo_target

    options = run.options
    initial = build_demo_model(run.root / "model-init")
    result = train_demo_target(
        initial,
        run.target,
        run.conversations,
        TargetTraining(
            steps=options.target_steps,
            row_tokens=options.target_row_tokens,
            rows_per_step=options.target_rows_per_step,
            seed=options.seed,
            show_progress=options.show_progress,
        ),
    )
    return {"target": str(run.target)}, {
        "tokens": result.tokens,
        "tokens_per_second": result.tokens_per_second,
        "first_loss": result.first_loss,
        "last_loss": result.last_loss,
    }


def _datagen_stage(run: _DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.data_generation.offline import run_datagen
    from speculators_vllm016.data_generation.options import (
        DatagenOptions,
        EngineOptions,
        OutputOptions,
        PreprocessingOptions,
    )

    options = run.options
    summary = run_datagen(
        DatagenOptions(
            engine=EngineOptions(target_model_path=str(run.target), dtype=options.dtype),
            preprocessing=PreprocessingOptions(
                train_data_path=str(run.conversations),
                seq_length=options.seq_length,
                max_samples=options.max_samples,
                hf_cache_dir=str(run.root / "hf-datasets-cache"),
                seed=options.seed,
                num_preprocessing_workers=min(2, os.cpu_count() or 1),
            ),
            output=OutputOptions(
                output_dir=str(run.root / "data"),
                output_format=options.output_format,
                batch_size=options.batch_size,
                show_progress=options.show_progress,
            ),
        )
    )
    return {"data": summary.output_dir}, {
        "samples": summary.samples_total,
        "tokens": summary.tokens_extracted,
        "tokens_per_second": summary.tokens_per_second,
    }


def _vocab_stage(run: _DemoRun) -> tuple[dict, dict]:
    from transformers import AutoConfig

    from speculators_vllm016.data_generation.token_counts import load_token_freq
    from speculators_vllm016.train.vocab_maps import write_vocab_mappings_from_counts

    target_vocab = int(AutoConfig.from_pretrained(run.target).vocab_size)
    counts = load_token_freq(run.root / "data")
    d2t, t2d = write_vocab_mappings_from_counts(
        counts, run.options.draft_vocab_size, target_vocab, run.root / "vocab"
    )
    return {"d2t": str(d2t), "t2d": str(t2d)}, {
        "draft_vocab_size": run.options.draft_vocab_size,
        "target_vocab_size": target_vocab,
        "distinct_tokens_seen": len(counts),
    }


def _initial_draft_stage(run: _DemoRun) -> tuple[dict, dict]:
    _save_initial_draft(run.train_config(), run.untrained)
    return {"untrained_draft": str(run.untrained)}, {}


def _train_stage(run: _DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.train.jobs.job import run_train_job
    from speculators_vllm016.train.logger import METRICS_FILE

    started = time.perf_counter()
    run_train_job(run.train_config(), report=lambda result: print(result.describe()))
    seconds = time.perf_counter() - started
    metrics = read_training_metrics(run.checkpoints / METRICS_FILE)
    tokens, rate = training_throughput(metrics, seconds)
    curves = run.root / "training_curves.png"
    try:
        plot_training_curves(metrics, curves)
    except ImportError:
        curves = Path("(no PNG: pip install matplotlib)")
    return {
        "checkpoints": str(run.checkpoints),
        "trained_draft": str(run.trained),
        "curves": str(curves),
        "metrics": str(run.checkpoints / METRICS_FILE),
    }, {
        "steps": len(metrics),
        "tokens": tokens,
        "tokens_per_second": rate,
        "first_loss": metrics[0].get("loss") if metrics else None,
        "last_loss": metrics[-1].get("loss") if metrics else None,
    }


def _eval_stage(run: _DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.evaluate.report import format_table, write_json, write_plot
    from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation

    report = run_evaluation(
        EvalOptions(
            drafts=[str(run.untrained), str(run.trained)],
            data_path=str(run.conversations),
            verifier=str(run.target),
            max_prompts=run.options.eval_prompts,
            max_new_tokens=run.options.max_new_tokens,
            engine="hf",
            device="cpu",
            hf_cache_dir=str(run.root / "hf-datasets-cache"),
            show_progress=run.options.show_progress,
            labels=["untrained", "trained"],
        )
    )
    folder = run.root / "eval"
    write_json(report, folder / "eval.json")
    plot = folder / "acceptance.png"
    try:
        write_plot(report.drafts, plot, title="Demo: untrained vs trained draft")
    except ImportError:
        plot = Path("(no PNG: pip install matplotlib)")
    before, after = report.drafts
    return {"json": str(folder / "eval.json"), "plot": str(plot)}, {
        "table": format_table(report.drafts),
        "tau_untrained": before.counts.acceptance_length,
        "tau_trained": after.counts.acceptance_length,
        "rates_untrained": before.counts.per_position_rates,
        "rates_trained": after.counts.per_position_rates,
        "prompts": report.num_prompts,
    }


_DemoWork = Callable[[_DemoRun], tuple[dict, dict]]
_STAGES: dict[str, tuple[_DemoWork, Callable[[_DemoRun], list[Path]]]] = {
    "target": (_target_stage, lambda run: [run.target]),
    "datagen": (_datagen_stage, lambda run: [run.root / "data"]),
    "vocab": (_vocab_stage, lambda run: [run.root / "vocab"]),
    "initial draft": (_initial_draft_stage, lambda run: [run.untrained]),
    "train": (
        _train_stage,
        lambda run: [run.checkpoints, run.root / "logs", run.root / "training_curves.png"],
    ),
    "eval": (_eval_stage, lambda run: [run.root / "eval"]),
}
"""Each stage's work and the outputs removed before it runs with other options, in the order of
`stage_options` (a new stage: its options there, its work here)."""


def run_demo(options: DemoOptions) -> DemoResult:
    """Run (or resume) every stage; returns what each stage wrote and measured."""
    from speculators_vllm016.demo import demo_conversations_path
    from speculators_vllm016.demo.engine_dtype import choose_engine_dtype

    dtype, why = choose_engine_dtype(options.dtype)
    if why is not None:
        print(why)
    options = replace(options, dtype=dtype)  # the stages record the dtype that ran
    root = Path(options.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = _load_state(root)
    run = _DemoRun(options=options, root=root, conversations=demo_conversations_path())
    stages = [
        _run_stage(root, state, name, partial(work, run), depends, clear(run))
        for name, depends in stage_options(options).items()
        for work, clear in [_STAGES[name]]
    ]
    return DemoResult(root=root, stages=stages)
