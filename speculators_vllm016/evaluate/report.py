"""Results of `speculators eval`: one row per draft, as a table, a JSON file and a PNG."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from speculators_vllm016.evaluate.acceptance import AcceptanceCounts
from speculators_vllm016.evaluate.generation import tokens_per_second
from speculators_vllm016.evaluate.training_metrics import TrainingEstimate
from speculators_vllm016.utils.atomic_files import atomic_write

__all__ = [
    "DraftEvaluation",
    "EvaluationReport",
    "format_table",
    "tau_ratios",
    "write_json",
    "write_plot",
]


@dataclass
class DraftEvaluation:
    """Acceptance of one draft on the prompts."""

    draft: str
    label: str
    engine: str
    num_speculative_tokens: int
    counts: AcceptanceCounts
    generated_tokens: int
    seconds: float
    training: TrainingEstimate | None = None
    context_length: int | None = None
    """The context length asked for (`--context-lengths`; 0: each question alone); None: the
    plain prompts."""
    prompt_tokens: float | None = None
    """Mean tokens of the prompts measured (what the context length reached)."""

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.generated_tokens, self.seconds)

    def to_dict(self) -> dict:
        counts = self.counts
        return {
            "draft": self.draft,
            "label": self.label,
            "engine": self.engine,
            "num_speculative_tokens": self.num_speculative_tokens,
            "acceptance_length": counts.acceptance_length,
            "per_position_acceptance_rate": counts.per_position_rates,
            "draft_acceptance_rate": counts.draft_acceptance_rate,
            "num_drafts": counts.num_drafts,
            "num_draft_tokens": counts.num_draft_tokens,
            "num_accepted_tokens": counts.num_accepted_tokens,
            "num_accepted_tokens_per_pos": counts.accepted_per_position,
            "tau_sim": self.training.tau_sim if self.training else None,
            "training_full_acc": self.training.full_acc if self.training else None,
            "training_metrics_file": self.training.source if self.training else None,
            "generated_tokens": self.generated_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "context_length": self.context_length,
            "mean_prompt_tokens": self.prompt_tokens,
        }


@dataclass
class EvaluationReport:
    """Everything one `speculators eval` call measured."""

    verifier: str
    data_path: str
    num_prompts: int
    max_new_tokens: int
    engine: str
    drafts: list[DraftEvaluation] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "verifier": self.verifier,
            "data_path": self.data_path,
            "num_prompts": self.num_prompts,
            "max_new_tokens": self.max_new_tokens,
            "engine": self.engine,
            "drafts": [draft.to_dict() for draft in self.drafts],
        }


def tau_ratios(evaluations: Sequence[DraftEvaluation]) -> list[float | None]:
    """Each row's tau over the same draft's tau at its shortest context length (None for rows
    measured without `--context-lengths`): how much acceptance a draft keeps as prompts grow."""
    shortest: dict[str, DraftEvaluation] = {}
    for e in evaluations:
        if e.context_length is None:
            continue
        known = shortest.get(e.draft)
        if known is None or e.context_length < (known.context_length or 0):
            shortest[e.draft] = e
    ratios: list[float | None] = []
    for e in evaluations:
        base = shortest.get(e.draft) if e.context_length is not None else None
        tau = base.counts.acceptance_length if base else 0.0
        ratios.append(e.counts.acceptance_length / tau if base and tau > 0 else None)
    return ratios


def format_table(evaluations: Sequence[DraftEvaluation]) -> str:
    """A fixed-width table: tau, tau_sim, per-position rates, tokens/s per draft; with context
    lengths, one row per draft and length, the prompts' mean tokens and tau over the draft's
    tau at its shortest length."""
    positions = max(e.num_speculative_tokens for e in evaluations)
    by_context = any(e.context_length is not None for e in evaluations)
    header = ["draft"] + (["context", "prompt tok"] if by_context else []) + ["tau"]
    header += (["vs shortest"] if by_context else []) + ["tau_sim"]
    header += [f"pos{k + 1}" for k in range(positions)] + ["drafts", "tok/s"]
    rows = []
    for e, ratio in zip(evaluations, tau_ratios(evaluations)):
        rates = e.counts.per_position_rates
        row = [e.label]
        if by_context:
            row += [str(e.context_length), f"{e.prompt_tokens or 0:.0f}"]
        row.append(f"{e.counts.acceptance_length:.3f}")
        if by_context:
            row.append(f"{ratio:.3f}" if ratio is not None else "-")
        row.append(f"{e.training.tau_sim:.3f}" if e.training else "-")
        row += [f"{rates[k]:.3f}" if k < len(rates) else "-" for k in range(positions)]
        row += [str(e.counts.num_drafts), f"{e.tokens_per_second:.1f}"]
        rows.append(row)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def render(line: list[str]) -> str:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        return "  ".join(cells)

    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, rows)])


def _write_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write whole or not at all (a crash leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write, fsync=False)


def write_json(report: EvaluationReport, path: str | Path) -> None:
    text = json.dumps(report.to_dict(), indent=2) + "\n"
    _write_file(Path(path), lambda handle: handle.write(text.encode()))


def write_plot(evaluations: Sequence[DraftEvaluation], path: str | Path, title: str = "") -> None:
    """A PNG of per-position acceptance rates, one line per draft (matplotlib, imported here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for e in evaluations:
        rates = e.counts.per_position_rates
        at = f" at {e.context_length} tokens" if e.context_length is not None else ""
        label = f"{e.label}{at} (tau {e.counts.acceptance_length:.2f}"
        label += f", tau_sim {e.training.tau_sim:.2f})" if e.training else ")"
        axes.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    positions = max(e.num_speculative_tokens for e in evaluations)
    axes.set_xticks(range(1, positions + 1))
    axes.set_ylim(0.0, 1.05)
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate (accepted / drafts)")
    axes.set_title(title or "Per-position acceptance")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()

    try:
        _write_file(Path(path), lambda handle: figure.savefig(handle, format="png"))
    finally:
        plt.close(figure)
