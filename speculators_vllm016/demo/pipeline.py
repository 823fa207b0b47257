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
resumes (datagen, training and the target resume on their own after a crash).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators_vllm016.utils.atomic_files import (
    atomic_write,
    atomic_write_text,
    give_usual_modes,
    replace_folder,
)

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
class DemoResult:
    root: Path
    stages: list[StageRecord]

    def stage(self, name: str) -> StageRecord:
        return next(s for s in self.stages if s.name == name)


def _load_state(root: Path) -> dict[str, dict]:
    path = root / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_state(root: Path, state: dict[str, dict]) -> None:
    atomic_write_text(root / STATE_FILE, json.dumps(state, indent=2) + "\n")


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


def _changed(before: dict | None, now: dict) -> str:
    """The options that differ, for the log line (`before` None: not recorded)."""
    if before is None:
        return "its options were not recorded"
    keys = sorted(set(before) | set(now), key=str)
    return ", ".join(
        f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)
    )


def _run_stage(
    root: Path,
    state: dict[str, dict],
    name: str,
    work: Callable[[], tuple[dict, dict]],
    options: dict[str, Any] | None = None,
    outputs: Sequence[Path] = (),
) -> StageRecord:
    """Run `work` unless the state records it finished with the same `options`.

    `options`: everything the stage's result depends on (JSON values). When a record of the stage
    with other options exists, its `outputs` (files or folders) are removed first, so nothing
    of the old run is resumed or reused.
    """
    options = json.loads(json.dumps(options or {}))
    saved = state.get(name)
    if saved is not None and saved.get("options") == options and "outputs" in saved:
        return StageRecord(
            name=name,
            seconds=saved["seconds"],
            outputs=saved["outputs"],
            figures=saved["figures"],
            reused=True,
        )
    if saved is not None and saved.get("options") != options:
        print(f"[demo] {name}: running it again ({_changed(saved.get('options'), options)})")
        for path in outputs:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    state[name] = {"options": options}  # started: a crash with the same options resumes
    _save_state(root, state)
    started = time.perf_counter()
    result, figures = work()
    record = StageRecord(
        name=name, seconds=time.perf_counter() - started, outputs=result, figures=figures
    )
    state[name] = {
        "options": options,
        "seconds": record.seconds,
        "outputs": result,
        "figures": figures,
    }
    _save_state(root, state)
    return record


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


def run_demo(options: DemoOptions) -> DemoResult:
    """Run (or resume) every stage; returns what each stage wrote and measured."""
    from speculators_vllm016.demo import build_demo_model, demo_conversations_path
    from speculators_vllm016.demo.engine_dtype import choose_engine_dtype

    dtype, why = choose_engine_dtype(options.dtype)
    if why is not None:
        print(why)
    options = replace(options, dtype=dtype)  # the stages record the dtype that ran
    root = Path(options.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = _load_state(root)
    conversations = demo_conversations_path()
    stages: list[StageRecord] = []
    target = root / "target"

    def target_stage() -> tuple[dict, dict]:
        from speculators_vllm016.demo.target import TargetTraining, train_demo_target

        initial = build_demo_model(root / "model-init")
        result = train_demo_target(
            initial,
            target,
            conversations,
            TargetTraining(
                steps=options.target_steps,
                row_tokens=options.target_row_tokens,
                rows_per_step=options.target_rows_per_step,
                seed=options.seed,
                show_progress=options.show_progress,
            ),
        )
        return {"target": str(target)}, {
            "tokens": result.tokens,
            "tokens_per_second": result.tokens_per_second,
            "first_loss": result.first_loss,
            "last_loss": result.last_loss,
        }

    depends = stage_options(options)
    stages.append(_run_stage(root, state, "target", target_stage, depends["target"], [target]))

    def datagen_stage() -> tuple[dict, dict]:
        from speculators_vllm016.data_generation.offline import run_datagen
        from speculators_vllm016.data_generation.options import (
            DatagenOptions,
            EngineOptions,
            OutputOptions,
            PreprocessingOptions,
        )

        summary = run_datagen(
            DatagenOptions(
                engine=EngineOptions(target_model_path=str(target), dtype=options.dtype),
                preprocessing=PreprocessingOptions(
                    train_data_path=str(conversations),
                    seq_length=options.seq_length,
                    max_samples=options.max_samples,
                    hf_cache_dir=str(root / "hf-datasets-cache"),
                    seed=options.seed,
                    num_preprocessing_workers=min(2, os.cpu_count() or 1),
                ),
                output=OutputOptions(
                    output_dir=str(root / "data"),
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

    stages.append(
        _run_stage(root, state, "datagen", datagen_stage, depends["datagen"], [root / "data"])
    )

    def vocab_stage() -> tuple[dict, dict]:
        from transformers import AutoConfig

        from speculators_vllm016.data_generation.token_counts import load_token_freq
        from speculators_vllm016.train.vocab_maps import write_vocab_mappings_from_counts

        target_vocab = int(AutoConfig.from_pretrained(target).vocab_size)
        counts = load_token_freq(root / "data")
        d2t, t2d = write_vocab_mappings_from_counts(
            counts, options.draft_vocab_size, target_vocab, root / "vocab"
        )
        return {"d2t": str(d2t), "t2d": str(t2d)}, {
            "draft_vocab_size": options.draft_vocab_size,
            "target_vocab_size": target_vocab,
            "distinct_tokens_seen": len(counts),
        }

    stages.append(_run_stage(root, state, "vocab", vocab_stage, depends["vocab"], [root / "vocab"]))
    train_config = _train_config(options, root, target)
    untrained = root / "draft-untrained"

    def draft_stage() -> tuple[dict, dict]:
        _save_initial_draft(train_config, untrained)
        return {"untrained_draft": str(untrained)}, {}

    stages.append(
        _run_stage(root, state, "initial draft", draft_stage, depends["initial draft"], [untrained])
    )
    save = root / "checkpoints"
    trained = save / str(options.epochs - 1)

    def train_stage() -> tuple[dict, dict]:
        from speculators_vllm016.train.jobs.job import run_train_job
        from speculators_vllm016.train.logger import METRICS_FILE

        started = time.perf_counter()
        run_train_job(train_config, report=lambda result: print(result.describe()))
        seconds = time.perf_counter() - started
        metrics = read_training_metrics(save / METRICS_FILE)
        tokens, rate = training_throughput(metrics, seconds)
        curves = root / "training_curves.png"
        try:
            plot_training_curves(metrics, curves)
        except ImportError:
            curves = Path("(no PNG: pip install matplotlib)")
        return {
            "checkpoints": str(save),
            "trained_draft": str(trained),
            "curves": str(curves),
            "metrics": str(save / METRICS_FILE),
        }, {
            "steps": len(metrics),
            "tokens": tokens,
            "tokens_per_second": rate,
            "first_loss": metrics[0].get("loss") if metrics else None,
            "last_loss": metrics[-1].get("loss") if metrics else None,
        }

    stages.append(
        _run_stage(
            root,
            state,
            "train",
            train_stage,
            depends["train"],
            [save, root / "logs", root / "training_curves.png"],
        )
    )

    def eval_stage() -> tuple[dict, dict]:
        from speculators_vllm016.evaluate.report import format_table, write_json, write_plot
        from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation

        report = run_evaluation(
            EvalOptions(
                drafts=[str(untrained), str(trained)],
                data_path=str(conversations),
                verifier=str(target),
                max_prompts=options.eval_prompts,
                max_new_tokens=options.max_new_tokens,
                engine="hf",
                device="cpu",
                hf_cache_dir=str(root / "hf-datasets-cache"),
                show_progress=options.show_progress,
                labels=["untrained", "trained"],
            )
        )
        folder = root / "eval"
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

    stages.append(_run_stage(root, state, "eval", eval_stage, depends["eval"], [root / "eval"]))
    return DemoResult(root=root, stages=stages)
