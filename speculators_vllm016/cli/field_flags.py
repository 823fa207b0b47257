"""A dataclass field as its command-line flag: the one way both `speculators train` and
`speculators datagen` declare their flags.

A flag is declared once, as a field of an options dataclass (`train.jobs.job_config`'s sections,
`data_generation.options`' parts): its name gives the flag (`seq_length` -> `--seq-length`), its
type the argparse type, its default the default, its `choices` / `flag` metadata the rest, and the
docstring under it the help (`utils.field_docs`). A field added to one of those classes with its
docstring appears on the command line with nothing else to change.

A command that shows another command's fields (`speculators regenerate` the target-model and data
fields of datagen's options) says how in one `FlagView`: which fields, and where its flag name,
default or a note differ. Each command lists what its flags come from (`FlagSource`s), so a test
can hold that its parser has exactly those flags, each once (tests/cli/test_flags_declared_once.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from speculators_vllm016.train.jobs.job_config import FieldSpec, config_fields

__all__ = [
    "FlagSource",
    "FlagView",
    "add_field_flag",
    "add_flag_sources",
    "add_option_flags",
    "option_field_specs",
    "source_flags",
]


@dataclass(frozen=True)
class FlagView:
    """How one command shows the fields of an options dataclass declared for another."""

    names: tuple[str, ...] | None = None
    """The fields shown, in this order (None: every field, in declaration order)."""
    flags: dict[str, str] = field(default_factory=dict)
    """Field name -> this command's flag for it, where the field's own flag means something else
    here (`--seed`); the parsed value keeps the field's name."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Field name -> this command's default, where it differs from the field's."""
    notes: dict[str, str] = field(default_factory=dict)
    """Field name -> a sentence added to the field's docstring: what it means in this command."""


@dataclass(frozen=True)
class FlagSource:
    """One argument group of a command: its title ("": the parser's own options), the options
    dataclass and how it is shown."""

    title: str
    cls: type
    view: FlagView = field(default_factory=FlagView)


def add_field_flag(group: Any, spec: FieldSpec, default: object, dest: str | None = None) -> None:
    """One field as its flag: type, choices and help from the field itself. A bool that is on
    by default and whose flag says `--no-...` (`show_progress` as `--no-progress`) is that
    flag's switch, stored under the flag's name. `dest`: where the value is parsed to (None:
    argparse's name from the flag)."""
    kwargs: dict = {"default": default, "help": spec.doc.replace("%", "%%") or None}
    if dest is not None:
        kwargs["dest"] = dest
    if spec.type is bool and default is True and spec.flag.startswith("--no-"):
        kwargs.update(action="store_true", default=False, dest=spec.flag[2:].replace("-", "_"))
    elif spec.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if spec.negatable else "store_true"
    elif spec.type is list:
        kwargs.update(type=int, nargs="+")
    elif spec.type is not str:  # argparse's values are text already
        kwargs["type"] = spec.type
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    if spec.required and not default:  # unless the --config file gave it
        kwargs.update(required=True, default=None)
    group.add_argument(spec.flag, **kwargs)


def option_field_specs(cls: type) -> list[FieldSpec]:
    """The fields of an options dataclass as flags; a field without a default is required."""
    required = {
        item.name
        for item in dataclasses.fields(cls)
        if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
    }
    return [
        dataclasses.replace(spec, required=True, default=None) if spec.name in required else spec
        for spec in config_fields(cls)
    ]


def _viewed_specs(cls: type, view: FlagView) -> list[tuple[FieldSpec, str | None]]:
    """The fields `view` shows, each as this command's `FieldSpec` and its parsed name."""
    specs = {spec.name: spec for spec in option_field_specs(cls)}
    names = list(specs) if view.names is None else list(view.names)
    unknown = sorted(
        {*names, *view.flags, *view.defaults, *view.notes} - set(specs)
    )  # a typo in a view must not quietly drop a flag
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}")
    shown = []
    for name in names:
        spec = specs[name]
        doc = " ".join(filter(None, [spec.doc, view.notes.get(name, "")]))
        changes: dict[str, Any] = {"doc": doc}
        if name in view.defaults:
            changes.update(default=view.defaults[name], required=False)
        if name in view.flags:
            changes["flag"] = view.flags[name]
        spec = dataclasses.replace(spec, **changes)
        shown.append((spec, name if name in view.flags else None))
    return shown


def add_option_flags(group: Any, cls: type, view: FlagView | None = None) -> None:
    """The fields of the options dataclass `cls` (those `view` shows, as it shows them) as flags
    of `group`."""
    for spec, dest in _viewed_specs(cls, view or FlagView()):
        add_field_flag(group, spec, spec.default, dest=dest)


def add_flag_sources(parser: argparse.ArgumentParser, sources: list[FlagSource]) -> None:
    """Each source's flags in the argument group of its title (sources of one title share it)."""
    groups: dict[str, Any] = {}
    for source in sources:
        if source.title not in groups:
            titled = parser.add_argument_group(source.title) if source.title else parser
            groups[source.title] = titled
        add_option_flags(groups[source.title], source.cls, source.view)


def source_flags(sources: list[FlagSource]) -> list[str]:
    """The flags `sources` declare, in order (one per shown field)."""
    return [spec.flag for source in sources for spec, _ in _viewed_specs(source.cls, source.view)]
