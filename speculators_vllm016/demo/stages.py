"""The work of each demo stage, and the outputs a stage removes before it runs with other options.

`demo.pipeline` decides which stage runs (its options in `stage_options`); each function here
does one stage's work for one run and returns the paths it wrote and the figures it measured.
The shipped-data draft lives in the demo folder itself, the regenerated-data draft in
`<output>/regenerated/` (its own conversations, hidden states, maps and checkpoints).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculators_vllm016.demo.draft_training import (
    DraftLane,
    plot_training_curves,
    read_training_metrics,
    save_initial_draft,
    train_config,
    training_throughput,
)
from speculators_vllm016.demo.held_out import DRAFT_FILE, HELD_OUT_FILE, TARGET_FILE
from speculators_vllm016.demo.serving import serve_stage

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.options import DatagenOptions
    from speculators_vllm016.demo.options import DemoOptions

__all__ = ["STAGES", "DemoRun"]


@dataclass(frozen=True)
class DemoRun:
    """What every stage of one demo run reads: its options and where things go."""

    options: DemoOptions
    root: Path
    conversations: Path
    """The shipped conversations, which the split stage cuts into parts."""

    @property
    def split(self) -> Path:
        return self.root / "conversations"

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def untrained(self) -> Path:
        return self.root / "draft-untrained"

    @property
    def shipped(self) -> DraftLane:
        return DraftLane(self.root)

    @property
    def regenerated(self) -> DraftLane:
        return DraftLane(self.root / "regenerated")

    @property
    def regenerated_conversations(self) -> Path:
        return self.regenerated.folder / "conversations"

    def trained(self, lane: DraftLane) -> Path:
        return lane.checkpoints / str(self.options.epochs - 1)


def _split_stage(run: DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.demo.held_out import split_of_file, write_split

    options = run.options
    lines, split = split_of_file(run.conversations, options.held_out_every, options.max_samples)
    paths = write_split(lines, split, run.split)
    return {name: str(path) for name, path in paths.items()}, {
        "rows": len(lines),
        "target_rows": len(split.target),
        "draft_rows": len(split.drafts),
        "held_out_rows": split.held_out,
        "set_aside_rows": len(split.set_aside),
    }


def _target_stage(run: DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.demo import build_demo_model
    from speculators_vllm016.demo.target import TargetTraining, train_demo_target

    options = run.options
    initial = build_demo_model(run.root / "model-init", run.split / TARGET_FILE)
    result = train_demo_target(
        initial,
        run.target,
        run.split / TARGET_FILE,
        TargetTraining(
            steps=options.target_steps,
            row_tokens=options.target_row_tokens,
            rows_per_step=options.target_rows_per_step,
            long_row_tokens=options.target_long_row_tokens,
            long_every=options.target_long_every,
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


def _datagen_options(run: DemoRun, data_path: Path, output_dir: Path) -> DatagenOptions:
    """Datagen of every row of `data_path` into `output_dir`, as the demo extracts."""
    from speculators_vllm016.data_generation.options import (
        DatagenOptions,
        EngineOptions,
        OutputOptions,
        PreprocessingOptions,
    )

    options = run.options
    return DatagenOptions(
        engine=EngineOptions(target_model_path=str(run.target), dtype=options.dtype),
        preprocessing=PreprocessingOptions(
            train_data_path=str(data_path),
            seq_length=options.seq_length,
            hf_cache_dir=str(run.root / "hf-datasets-cache"),
            seed=options.seed,
            num_preprocessing_workers=min(2, os.cpu_count() or 1),
        ),
        output=OutputOptions(
            output_dir=str(output_dir),
            output_format=options.output_format,
            batch_size=options.batch_size,
            show_progress=options.show_progress,
        ),
    )


def _datagen_stage(run: DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.data_generation.offline import run_datagen

    lane = run.shipped
    summary = run_datagen(_datagen_options(run, run.split / DRAFT_FILE, lane.data))
    return {"data": summary.output_dir}, {
        "samples": summary.samples_total,
        "tokens": summary.tokens_extracted,
        "tokens_per_second": summary.tokens_per_second,
    }


def _regenerated_datagen_stage(run: DemoRun) -> tuple[dict, dict]:
    """The drafts' conversations answered greedily by the target, then their hidden states: one
    engine load (`datagen --regenerate`)."""
    from speculators_vllm016.data_generation.regeneration.one_pass import (
        run_datagen_regenerating,
    )
    from speculators_vllm016.data_generation.regeneration.options import (
        RegenerateOptions,
        SamplingOptions,
    )

    options = run.options
    lane = run.regenerated
    regenerated, extracted = run_datagen_regenerating(
        _datagen_options(run, run.split / DRAFT_FILE, lane.data),
        RegenerateOptions(
            target_model_path=str(run.target),
            train_data_path=str(run.split / DRAFT_FILE),
            output_dir=str(run.regenerated_conversations),
            sampling=SamplingOptions(
                temperature=0.0, max_tokens=options.regenerate_max_tokens, seed=options.seed
            ),
            max_prompt_tokens=options.seq_length,
            dtype=options.dtype,
            hf_cache_dir=str(run.root / "hf-datasets-cache"),
            num_preprocessing_workers=min(2, os.cpu_count() or 1),
            show_progress=options.show_progress,
        ),
    )
    return {"conversations": regenerated.output_file, "data": extracted.output_dir}, {
        "rows": regenerated.rows_in_shard,
        "not_regenerated": regenerated.failed,
        "failure_reasons": regenerated.failure_reasons,
        "turns_cut_at_max_tokens": regenerated.turns_cut_at_max_tokens,
        "samples": extracted.samples_total,
        "tokens": extracted.tokens_extracted,
        "tokens_per_second": extracted.tokens_per_second,
    }


def _vocab_stage(run: DemoRun, lane: DraftLane) -> tuple[dict, dict]:
    from transformers import AutoConfig

    from speculators_vllm016.data_generation.token_counts import load_token_freq
    from speculators_vllm016.train.vocab_maps import write_vocab_mappings_from_counts

    target_vocab = int(AutoConfig.from_pretrained(run.target).vocab_size)
    counts = load_token_freq(lane.data)
    d2t, t2d = write_vocab_mappings_from_counts(
        counts, run.options.draft_vocab_size, target_vocab, lane.vocab
    )
    return {"d2t": str(d2t), "t2d": str(t2d)}, {
        "draft_vocab_size": run.options.draft_vocab_size,
        "target_vocab_size": target_vocab,
        "distinct_tokens_seen": len(counts),
    }


def _initial_draft_stage(run: DemoRun) -> tuple[dict, dict]:
    save_initial_draft(train_config(run.options, run.shipped, run.target), run.untrained)
    return {"untrained_draft": str(run.untrained)}, {}


def _train_stage(run: DemoRun, lane: DraftLane) -> tuple[dict, dict]:
    from speculators_vllm016.train.jobs.job import run_train_job
    from speculators_vllm016.train.logger import METRICS_FILE

    started = time.perf_counter()
    config = train_config(run.options, lane, run.target)
    run_train_job(config, report=lambda result: print(result.describe()))
    seconds = time.perf_counter() - started
    metrics = read_training_metrics(lane.checkpoints / METRICS_FILE)
    tokens, rate = training_throughput(metrics, seconds)
    curves = lane.curves
    try:
        plot_training_curves(metrics, curves)
    except ImportError:
        curves = Path("(no PNG: pip install matplotlib)")
    return {
        "checkpoints": str(lane.checkpoints),
        "trained_draft": str(run.trained(lane)),
        "curves": str(curves),
        "metrics": str(lane.checkpoints / METRICS_FILE),
    }, {
        "steps": len(metrics),
        "tokens": tokens,
        "tokens_per_second": rate,
        "first_loss": metrics[0].get("loss") if metrics else None,
        "last_loss": metrics[-1].get("loss") if metrics else None,
    }


def _eval_stage(run: DemoRun) -> tuple[dict, dict]:
    from speculators_vllm016.evaluate.report import format_table, write_json, write_plot
    from speculators_vllm016.evaluate.runner import EvalOptions, run_evaluation

    drafts = {"untrained": run.untrained, "shipped": run.trained(run.shipped)}
    if run.options.regenerate:
        drafts["regenerated"] = run.trained(run.regenerated)
    report = run_evaluation(
        EvalOptions(
            drafts=[str(path) for path in drafts.values()],
            data_path=str(run.split / HELD_OUT_FILE),
            verifier=str(run.target),
            max_prompts=run.options.eval_prompts,
            max_new_tokens=run.options.max_new_tokens,
            engine="hf",
            device="cpu",
            hf_cache_dir=str(run.root / "hf-datasets-cache"),
            show_progress=run.options.show_progress,
            labels=list(drafts),
        )
    )
    folder = run.root / "eval"
    write_json(report, folder / "eval.json")
    plot = folder / "acceptance.png"
    try:
        write_plot(report.drafts, plot, title="Demo: drafts on held-out prompts")
    except ImportError:
        plot = Path("(no PNG: pip install matplotlib)")
    figures: dict = {"table": format_table(report.drafts), "prompts": report.num_prompts}
    for label, evaluation in zip(drafts, report.drafts, strict=True):
        figures[f"tau_{label}"] = evaluation.counts.acceptance_length
        figures[f"rates_{label}"] = evaluation.counts.per_position_rates
    return {"json": str(folder / "eval.json"), "plot": str(plot)}, figures


StageWork = Callable[[DemoRun], tuple[dict, dict]]
STAGES: dict[str, tuple[StageWork, Callable[[DemoRun], list[Path]]]] = {
    "split": (_split_stage, lambda run: [run.split]),
    "target": (_target_stage, lambda run: [run.target, run.root / "model-init"]),
    "datagen": (_datagen_stage, lambda run: [run.shipped.data]),
    "vocab": (lambda run: _vocab_stage(run, run.shipped), lambda run: [run.shipped.vocab]),
    "initial draft": (_initial_draft_stage, lambda run: [run.untrained]),
    "train": (
        lambda run: _train_stage(run, run.shipped),
        lambda run: [run.shipped.checkpoints, run.shipped.logs, run.shipped.curves],
    ),
    "regen datagen": (
        _regenerated_datagen_stage,
        lambda run: [run.regenerated_conversations, run.regenerated.data],
    ),
    "regen vocab": (
        lambda run: _vocab_stage(run, run.regenerated),
        lambda run: [run.regenerated.vocab],
    ),
    "regen train": (
        lambda run: _train_stage(run, run.regenerated),
        lambda run: [run.regenerated.checkpoints, run.regenerated.logs, run.regenerated.curves],
    ),
    "eval": (_eval_stage, lambda run: [run.root / "eval"]),
    "serve": (serve_stage, lambda run: []),
}
"""Each stage's work and the outputs removed before it runs with other options, in the order of
`demo.pipeline.stage_options` (a new stage: its options there, its work here)."""
