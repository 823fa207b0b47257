"""Where stages' records live. Every write is atomic: a crash leaves the old record or the new.

- `StateFile`: one JSON file for a chain, a section per stage (`demo_state.json`): the options
  when the stage starts, then its seconds and output fields when it finishes.
- `DoneFile`: a stage's options, written only when it finished, into a file beside its output
  (`data/.datagen_done.json`): a folder moved or copied elsewhere keeps its record.
- `NoRecord`: a stage that always runs (its own work resumes, as training does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speculators_vllm016.pipeline.runner import StageEntry
from speculators_vllm016.utils.atomic_files import atomic_write_text

__all__ = ["DoneFile", "NoRecord", "StateFile"]

_RECORD_KEYS = ("options", "seconds")


class StateFile:
    """Every stage of a chain in one JSON file: `{name: {"options", "seconds", <output fields>}}`;
    a stage that started but did not finish has only `"options"`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sections: dict[str, dict[str, Any]] = (
            json.loads(path.read_text()) if path.is_file() else {}
        )

    def read(self, name: str) -> StageEntry | None:
        saved = self.sections.get(name)
        if saved is None:
            return None
        output = {k: v for k, v in saved.items() if k not in _RECORD_KEYS}
        return StageEntry(
            options=saved.get("options"),
            finished="seconds" in saved,
            seconds=saved.get("seconds", 0.0),
            output=output or None,
        )

    def started(self, name: str, options: dict[str, Any]) -> None:
        self.sections[name] = {"options": options}
        self._save()

    def finished(
        self, name: str, options: dict[str, Any], seconds: float, output: dict[str, Any] | None
    ) -> None:
        self.sections[name] = {"options": options, "seconds": seconds, **(output or {})}
        self._save()

    def _save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.sections, indent=2) + "\n")


class DoneFile:
    """One stage's options in a file of their own, written once the stage finished.

    `defaults`: what a record written before an option existed meant by it (the value that
    option's default gives, which is how that run behaved), so that adding an option to the
    stage does not make every earlier record look like another run.
    """

    def __init__(self, path: Path, defaults: Mapping[str, Any] | None = None) -> None:
        self.path = path
        self.defaults = dict(defaults or {})

    def read(self, name: str) -> StageEntry | None:
        if not self.path.is_file():
            return None
        recorded = json.loads(self.path.read_text())
        return StageEntry(options={**self.defaults, **recorded}, finished=True)

    def started(self, name: str, options: dict[str, Any]) -> None:
        """Nothing: the stage's own work resumes after a crash, whatever its options."""

    def finished(
        self, name: str, options: dict[str, Any], seconds: float, output: dict[str, Any] | None
    ) -> None:
        atomic_write_text(self.path, json.dumps(options, indent=2) + "\n")


class NoRecord:
    """No record: the stage runs every time."""

    def read(self, name: str) -> StageEntry | None:
        return None

    def started(self, name: str, options: dict[str, Any]) -> None:
        pass

    def finished(
        self, name: str, options: dict[str, Any], seconds: float, output: dict[str, Any] | None
    ) -> None:
        pass
