"""The training job's configuration: every setting of `speculators train`, typed and documented.

One source of truth for the command line, YAML job files and code (the demo, gen-and-train):
- each section is a dataclass (declared in `job_sections`, re-exported here) and the docstring
  under each field says what it does, its unit and why its default; `speculators train --help`
  shows those very words;
- each field is one command-line flag, `--` + the field name with dashes (0.3.0's flag names,
  so the field names are 0.3.0's too, `no_` prefixes included), unless `metadata["flag"]` names
  it otherwise;
- the online section nests datagen's own option parts (`data_generation.options`): their fields
  are its flags and keys, flat under `online:` as datagen's flags are, with datagen's types,
  defaults, choices and docstrings (`DatagenPart` says which, renamed how, with what note);
- a YAML file (`speculators train --config job.yaml`) sets the same fields by section:

      model:
        verifier_name_or_path: meta-llama/Llama-3.1-8B-Instruct
      training:
        epochs: 3
        lr: 3.0e-5

  flags given on the command line override it, and the resolved config is written beside the
  checkpoints (`<save_path>/train_config.yaml`, `save_job_config`).

The checks that need more than one field or the disk are `train.jobs.setup.prepare`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_vllm016.train.jobs.job_sections import (
    CheckpointConfig,
    DataConfig,
    DatagenPart,
    LegacyConfig,
    LoggingConfig,
    ModelConfig,
    OnlineConfig,
    RuntimeConfig,
    TrainingConfig,
    VocabConfig,
)
from speculators_vllm016.utils.atomic_files import atomic_write_text
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.field_docs import field_docs

__all__ = [
    "CONFIG_FILE",
    "FieldSpec",
    "JobConfigError",
    "all_fields",
    "TrainJobConfig",
    "TrainSetupError",
    "config_fields",
    "load_job_config",
    "save_job_config",
]

CONFIG_FILE = "train_config.yaml"  # the resolved config, beside the checkpoints


class TrainSetupError(InvalidInputError):
    """Bad input found before training starts; the message names the fix."""


class JobConfigError(TrainSetupError):
    """A job file that cannot be read as a `TrainJobConfig`; the message names the key."""


@dataclass
class TrainJobConfig:
    """Every setting of one `speculators train` job, by section (the YAML file's top-level keys)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    legacy: LegacyConfig = field(default_factory=LegacyConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """`{section: {field: value}}`, the YAML file's shape (the online section's datagen
        parts flattened into it, under their keys)."""
        sections = {}
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            sections[section.name] = {
                spec.name: copy.deepcopy(spec.read(values)) for spec in config_fields(type(values))
            }
        return sections

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "the job config") -> TrainJobConfig:
        """The config with `values` (`{section: {field: value}}`) over the defaults.

        An unknown section or field, or a value of the wrong type, is a `JobConfigError` naming
        the key (`source` names where the values came from)."""
        if not isinstance(values, dict):
            raise JobConfigError(
                f"{source}: expected a mapping of sections, got {type(values).__name__}"
            )
        config = cls()
        sections = {f.name: f for f in dataclasses.fields(cls)}
        for name, section_values in values.items():
            if name not in sections:
                raise JobConfigError(
                    f"{source}: unknown key {name!r}; the sections are {', '.join(sections)}"
                )
            if section_values is None:
                continue
            section = getattr(config, name)
            if not isinstance(section_values, dict):
                raise JobConfigError(f"{source}: {name!r} must be a mapping of its fields")
            known = {spec.name: spec for spec in config_fields(type(section))}
            for key, value in section_values.items():
                if key not in known:
                    raise JobConfigError(
                        f"{source}: unknown key '{name}.{key}'; {name}'s fields are {', '.join(known)}"
                    )
                known[key].write(section, known[key].coerce(value, f"{source}: '{name}.{key}'"))
        return config

    def with_flat(self, values: dict[str, Any]) -> TrainJobConfig:
        """A copy with `values` keyed by flag dest (`epochs`, `online`, ...) set in their sections."""
        config = copy.deepcopy(self)
        where = {spec.dest: (section, spec) for section, spec in all_fields()}
        for dest, value in values.items():
            section, spec = where[dest]
            spec.write(getattr(config, section), value)
        return config

    def flat(self) -> dict[str, Any]:
        """`{flag dest: value}` over every section: the shape a command line parses into."""
        return {spec.dest: spec.read(getattr(self, section)) for section, spec in all_fields()}


@dataclass(frozen=True)
class FieldSpec:
    """One field of a section and how it is written on a command line."""

    name: str  # the YAML key in its section
    type: type  # int, float, str, bool or list (of int)
    optional: bool  # None is allowed
    default: Any
    doc: str
    flag: str
    choices: tuple | None
    required: bool
    negatable: bool  # a bool with --x/--no-x (its default is True)
    path: tuple[str, ...]  # attributes from the section object to the value: (name,) or nested

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def read(self, section: Any) -> Any:
        """This field's value in `section` (an instance of its section class)."""
        for attribute in self.path:
            section = getattr(section, attribute)
        return section

    def write(self, section: Any, value: Any) -> None:
        """Set this field's value in `section`."""
        for attribute in self.path[:-1]:
            section = getattr(section, attribute)
        setattr(section, self.path[-1], value)

    def coerce(self, value: Any, where: str) -> Any:
        """`value` from a YAML file as this field's type (YAML 1.1 reads `1e-4` as a string)."""
        if value is None:
            if self.optional:
                return None
            raise JobConfigError(f"{where} cannot be null")
        try:
            if self.type is bool:
                if not isinstance(value, bool):
                    raise TypeError
                result: Any = value
            elif self.type is list:
                if not isinstance(value, list):
                    raise TypeError
                result = [_whole_number(v) for v in value]
            elif self.type is int:
                result = _whole_number(value)
            elif self.type is float:
                if isinstance(value, bool):
                    raise TypeError
                result = float(value)
            else:
                if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                    raise TypeError
                result = str(value)
        except (TypeError, ValueError):
            kind = {
                int: "an integer",
                float: "a number",
                str: "a string",
                bool: "true or false",
                list: "a list of integers",
            }[self.type]
            raise JobConfigError(f"{where} must be {kind}, got {value!r}") from None
        if self.choices is not None and result not in self.choices:
            raise JobConfigError(
                f"{where} must be one of {', '.join(map(str, self.choices))}, got {value!r}"
            )
        return result


def _whole_number(value: Any) -> int:
    """`value` as an int, refusing what `int()` would silently change: a bool (True is not 1
    epoch) and a float with a fraction (2.5 epochs is not 2)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError
    return int(value)


def config_fields(section: type) -> list[FieldSpec]:
    """The fields of one section class, with their docstrings and flag names; a nested datagen
    part (`datagen_part`) gives its shown fields in its place."""
    docs = field_docs(section)
    hints = typing.get_type_hints(section)
    specs = []
    for spec in dataclasses.fields(section):
        factory = spec.default_factory  # neither (an option without default): MISSING
        default = factory() if factory is not dataclasses.MISSING else spec.default  # type: ignore[misc]
        part = spec.metadata.get("datagen_part")
        if part is not None:
            specs.extend(_part_fields(spec.name, default, part))
        else:
            specs.append(_field_spec(spec, hints[spec.name], default, docs.get(spec.name, "")))
    return specs


def _part_fields(attribute: str, defaults: Any, part: DatagenPart) -> list[FieldSpec]:
    """The fields of a nested datagen part shown in the online section (`defaults`: the part as
    the section's factory makes it), keyed by their renamed names, docstrings with train's notes."""
    docs = field_docs(type(defaults))
    hints = typing.get_type_hints(type(defaults))
    specs = []
    for spec in dataclasses.fields(defaults):
        if part.names is not None and spec.name not in part.names:
            continue
        doc = " ".join(filter(None, [docs.get(spec.name, ""), part.notes.get(spec.name, "")]))
        specs.append(
            _field_spec(
                spec,
                hints[spec.name],
                getattr(defaults, spec.name),
                doc,
                name=part.rename.get(spec.name, spec.name),
                path=(attribute, spec.name),
            )
        )
    return specs


def _field_spec(
    spec: dataclasses.Field,
    hint: Any,
    default: Any,
    doc: str,
    name: str | None = None,
    path: tuple[str, ...] | None = None,
) -> FieldSpec:
    """One dataclass field as a `FieldSpec`; a field whose default is None accepts None (a
    required datagen field that train fills in, e.g. --target-model-path)."""
    name = spec.name if name is None else name
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint) or default is None
    base = args[0] if type(None) in typing.get_args(hint) else hint
    if typing.get_origin(base) is list:
        base = list
    choices = spec.metadata.get("choices")
    return FieldSpec(
        name=name,
        type=base,
        optional=optional,
        default=default,
        doc=doc,
        flag=spec.metadata.get("flag", "--" + name.replace("_", "-")),
        choices=tuple(choices) if choices is not None else None,
        required=bool(spec.metadata.get("required", False)),
        negatable=bool(spec.metadata.get("negatable", False)),
        path=(spec.name,) if path is None else path,
    )


def all_fields() -> list[tuple[str, FieldSpec]]:
    """`(section name, field)` for every field of the job config, in declaration order."""
    return [
        (section.name, spec)
        for section in dataclasses.fields(TrainJobConfig)
        for spec in config_fields(section.default_factory)  # type: ignore[arg-type]
    ]


def load_job_config(path: str | Path) -> TrainJobConfig:
    """A YAML job file as a config over the defaults (`JobConfigError` names a bad key)."""
    import yaml

    path = Path(path)
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise JobConfigError(
            f"cannot read the job file {path}: {error.strerror or error}"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise JobConfigError(f"{path} is not valid YAML{at}") from None
    return TrainJobConfig.from_dict(values or {}, source=str(path))


def save_job_config(config: TrainJobConfig, path: str | Path) -> Path:
    """Write `config` as YAML (whole or not at all); `load_job_config` reads it back equal."""
    import yaml

    text = yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)
    return atomic_write_text(path, text)
