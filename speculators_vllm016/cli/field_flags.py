"""A dataclass field as its command-line flag: the one way both `speculators train` and
`speculators datagen` declare their flags.

A flag is declared once, as a field of an options dataclass (`train.jobs.job_config`'s sections,
`data_generation.options`' parts): its name gives the flag (`seq_length` -> `--seq-length`), its
type the argparse type, its default the default, its `choices` / `flag` metadata the rest, and the
docstring under it the help (`utils.field_docs`). A field added to one of those classes with its
docstring appears on the command line with nothing else to change.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from speculators_vllm016.train.jobs.job_config import FieldSpec, config_fields

__all__ = ["add_field_flag", "add_option_flags", "option_field_specs"]


def add_field_flag(group: Any, spec: FieldSpec, default: object) -> None:
    """One field as its flag: type, choices and help from the field itself. A bool that is on
    by default and whose flag says `--no-...` (`show_progress` as `--no-progress`) is that
    flag's switch, stored under the flag's name."""
    kwargs: dict = {"default": default, "help": spec.doc.replace("%", "%%") or None}
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


def add_option_flags(group: Any, cls: type) -> None:
    """Every field of the options dataclass `cls` as a flag of `group`."""
    for spec in option_field_specs(cls):
        add_field_flag(group, spec, spec.default)
