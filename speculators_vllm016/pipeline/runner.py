"""Typed stages run in order; a stage finished earlier with the same inputs is not run again.

A stage names the options its result depends on, the stages whose rerun in this call makes it
run again, where its record lives (a `StageLedger`), and the files to remove before it runs
with other options. The runner asks the ledger before the stage runs, records the start
(a crash with the same options then resumes the stage's own work) and the finish (crash-safe:
every ledger writes atomically). Adding a stage to a chain is one more `Stage(...)` handed to
`StageRunner.run`, in order.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "Rerun",
    "Stage",
    "StageEntry",
    "StageLedger",
    "StageOutcome",
    "StageRunner",
    "changed_options",
]

OutputT = TypeVar("OutputT")


@dataclass(frozen=True)
class StageEntry:
    """What a ledger holds of a stage's last run."""

    options: dict[str, Any] | None
    """The options it ran with; None where the record names none (an older record)."""
    finished: bool
    seconds: float = 0.0
    output: dict[str, Any] | None = None
    """The output's fields as JSON, where the ledger keeps them (else None)."""


class StageLedger(Protocol):
    """Where a stage's record lives: read before it runs, written when it starts and finishes."""

    def read(self, name: str) -> StageEntry | None: ...

    def started(self, name: str, options: dict[str, Any]) -> None: ...

    def finished(
        self, name: str, options: dict[str, Any], seconds: float, output: dict[str, Any] | None
    ) -> None: ...


@dataclass(frozen=True)
class Rerun:
    """Why a stage with a record runs again: its options changed, or a stage it follows ran."""

    before: dict[str, Any] | None
    now: dict[str, Any]
    upstream: tuple[str, ...]
    """The stages of `Stage.after` that ran in this call."""

    @property
    def options_changed(self) -> bool:
        return self.before != self.now


def changed_options(before: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """The options that differ, for a log line (`before` None: not recorded)."""
    if before is None:
        return "its options were not recorded"
    keys = sorted(set(before) | set(now), key=str)
    return ", ".join(
        f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)
    )


@dataclass(frozen=True)
class Stage(Generic[OutputT]):
    """One step of a chain. `run` does the work and returns its typed output."""

    name: str
    run: Callable[[], OutputT]
    ledger: StageLedger
    options: Mapping[str, Any] = field(default_factory=dict)
    """Everything the result depends on (JSON values); another value makes the stage run again."""
    after: tuple[str, ...] = ()
    """Stages whose run in this call makes this one run again (it reads what they wrote)."""
    clear_on_change: tuple[Path, ...] = ()
    """Files or folders removed before the stage runs with options other than its record's,
    so nothing of the old run is resumed or reused."""
    output_type: Callable[..., OutputT] | None = None
    """Rebuilds the output of a reused stage from the fields its ledger kept."""
    on_reuse: Callable[[StageEntry], None] | None = None
    on_rerun: Callable[[Rerun], None] | None = None


@dataclass(frozen=True)
class StageOutcome(Generic[OutputT]):
    """A stage's output in this call, and whether it was reused from an earlier one."""

    name: str
    output: OutputT | None
    """None for a reused stage whose ledger keeps no output."""
    seconds: float
    reused: bool


def _remove(paths: tuple[Path, ...]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _output_json(output: object) -> dict[str, Any] | None:
    if is_dataclass(output) and not isinstance(output, type):
        return json.loads(json.dumps(asdict(output), default=str))
    return None


class StageRunner:
    """Runs stages in the order given, remembering which ran in this call."""

    def __init__(self, ran: set[str] | None = None) -> None:
        self.ran: set[str] = set() if ran is None else set(ran)
        """Names of the stages that ran (not reused) in this call."""

    def run(self, stage: Stage[OutputT]) -> StageOutcome[OutputT]:
        """Reuse the stage if its ledger says it finished with these options and no stage it
        follows ran; else run it (after removing `clear_on_change` if its options changed)."""
        options = json.loads(json.dumps(dict(stage.options)))
        entry = stage.ledger.read(stage.name)
        upstream = tuple(name for name in stage.after if name in self.ran)
        if entry is not None and entry.finished and entry.options == options and not upstream:
            if stage.on_reuse is not None:
                stage.on_reuse(entry)
            return StageOutcome(stage.name, self._recalled(stage, entry), entry.seconds, True)
        if entry is not None and (entry.options != options or upstream):
            if stage.on_rerun is not None:
                stage.on_rerun(Rerun(entry.options, options, upstream))
            if entry.options != options:
                _remove(stage.clear_on_change)
        stage.ledger.started(stage.name, options)
        started = time.perf_counter()
        output = stage.run()
        seconds = time.perf_counter() - started
        stage.ledger.finished(stage.name, options, seconds, _output_json(output))
        self.ran.add(stage.name)
        return StageOutcome(stage.name, output, seconds, False)

    @staticmethod
    def _recalled(stage: Stage[OutputT], entry: StageEntry) -> OutputT | None:
        if stage.output_type is None or entry.output is None:
            return None
        return stage.output_type(**entry.output)
