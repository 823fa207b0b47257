"""What a datagen run is asked to do, in three typed parts: engine, preprocessing and output.

Each part holds the flags of one group of `speculators datagen --help` (the same names, without the
dashes; `cli.field_flags` makes the flags from the fields, the docstrings are their help), and each
consumer takes the part it needs: the engine builder `EngineOptions`, the
preprocessing `PreprocessingOptions`, the folder and the writers `OutputOptions`. `DatagenOptions`
joins them; `DatagenOptions.from_args` is the one way from datagen's parsed flags to options.
`speculators train --online` nests the parts themselves in its job config (`OnlineConfig`): each
field here is one setting of both commands, its docstring the help of both.

`DatagenOptions(**flags)` with the flat flag names, and reading or setting `options.seq_length`,
keep working as they did when the options were one flat dataclass.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from speculators_vllm016.data_generation.sample_io import SAMPLE_PATTERNS
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.fp8_storage import STORAGE_DTYPES

__all__ = [
    "DTYPES",
    "DatagenOptions",
    "EngineOptions",
    "OutputOptions",
    "PreprocessingOptions",
    "RayOptions",
    "parse_template_kwargs",
]

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass
class EngineOptions:
    """The target model and its vLLM engine (datagen's "target model" flags)."""

    # The docstrings below are `speculators train --online`'s help for these flags too.
    target_model_path: str
    """HF model id or local folder of the target model."""
    tensor_parallel_size: int = 1
    """GPUs (or CPU workers) per model copy; 0.3.0 used every visible GPU, now 1."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per model copy."""
    max_model_len: int | None = None
    """Engine context length in tokens; None: datagen's --seq-length + 1."""
    gpu_memory_utilization: float = 0.8
    """Share of GPU memory vLLM may use."""
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    """Model dtype of the engine; auto: the model's own. Part of the run's identity (it changes
    every sample's bytes)."""
    max_num_seqs: int | None = None
    """Engine batch in sequences; None: max(32, datagen's --batch-size)."""
    max_num_batched_tokens: int | None = None
    """Tokens per engine step; None: max(8192, max model len)."""
    trust_remote_code: bool = False
    """Run Python code shipped in the model folder, where vLLM and transformers have no class of
    their own for it (e.g. Kimi-K2.5's tokenizer); off by default (0.3.0 always ran it)."""
    transfer_root: str | None = None
    """Folder for the shared-memory files that carry hidden states from the engine; None:
    $SPECULATORS_TRANSFER_ROOT, else /dev/shm, else the temp dir."""


@dataclass
class PreprocessingOptions:
    """Which chat rows become samples and how they are tokenized and masked
    (datagen's "data" flags); all of it is hashed into the run identity through the samples."""

    # The docstrings below are `speculators train --online`'s help for these flags too.
    train_data_path: str
    """Chat data: local .json/.jsonl (ShareGPT or messages shape), or 'sharegpt' / 'ultrachat'."""
    seq_length: int = 2048
    """Truncate samples to this many tokens."""
    max_samples: int | None = None
    """Use at most this many conversations; None: all."""
    hf_cache_dir: str | None = None
    """Datasets cache directory; None: the datasets library's own."""
    assistant_pattern: str | None = None
    """Regex whose first group is assistant text; None: found from the chat template."""
    turn_dropout: bool = False
    """Keep a random prefix of each conversation (an augmentation)."""
    seed: int = 0
    """Shuffle seed of the chat data (datagen's --seed, train's --data-seed)."""
    num_preprocessing_workers: int = 8
    """Processes for tokenizing."""
    chat_template_kwargs: str | None = None
    """JSON object of arguments for the chat template, e.g. '{"thinking": false}' (Kimi-K2.5's
    thinking switch); with datagen's --regenerate the target answers with them too. None: the
    template's own defaults, as 0.3.0 rendered."""
    session_tokens: int = 0
    """Also write long samples: the user/assistant pairs of the conversations, in their (seeded)
    order, chained into sessions of about this many tokens (whole pairs; at most --seq-length);
    0: none."""
    sessions_only: bool = False
    """With --session-tokens: write the sessions only, not the conversations themselves."""

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs` as the keyword arguments the template is rendered with."""
        return parse_template_kwargs(self.chat_template_kwargs)


@dataclass
class OutputOptions:
    """The sample files: where, which layers, in what format, by which shard and writers
    (datagen's "output" flags)."""

    output_dir: str
    """Folder of the sample files (train's `--cache-dir`; "" when online training keeps none)."""
    # The docstrings of the sample-file fields (output_format to fsync) are `speculators train
    # --online`'s help for these flags too (its sample files are those of --cache-dir).
    output_format: str = field(default="pt", metadata={"choices": tuple(SAMPLE_PATTERNS)})
    """Sample file format."""
    storage_dtype: str = field(default="bf16", metadata={"choices": STORAGE_DTYPES})
    """How hidden states are stored: "bf16" as the engine makes them, "fp8" as e4m3 with a scale
    per token and layer (half the bytes; read back by `speculators train` only;
    docs/storage-dtype.md measures what it costs)."""
    start_idx: int = 0
    """Index of the first sample file: row i becomes data_<start-idx + i>."""
    layer_ids: list[int] | None = None
    """Decoder layers captured (datagen's numbering: output of layer i); None: [2, N/2, N-3, N-1]
    of N layers."""
    num_writer_threads: int = 4
    """Threads writing sample files while extraction goes on."""
    fsync: bool = False
    """fsync every sample file (survives power loss; files are always whole after a crash)."""
    batch_size: int = 128
    """Sequences per extraction call (0.3.0 used 8). The engine runs a call's sequences
    continuously and samples are written as they finish, but each call ends with a partly filled
    step, so larger is faster; a resumed run computes only the missing samples."""
    num_shards: int = 1
    """Shards of the whole job; shard I extracts rows I, I+N, I+2N, ..."""
    shard_index: int = 0
    """This process's shard."""
    token_freq_path: str | None = None
    """Also write the token counts here (0.3.0's file; '.shard-I-of-N' is added when sharded);
    they always go to <output-dir>/token_freq/ too."""
    adopt_existing: bool = False
    """Accept a folder that holds sample files of an unrecorded run (e.g. 0.3.0's): each is
    checked against this run's samples and recomputed if it differs."""
    show_progress: bool = field(default=True, metadata={"flag": "--no-progress"})
    """Show the progress bar; `--no-progress` hides it."""


@dataclass
class RayOptions:
    """Every shard of the job as a Ray task from one command (`data_generation.ray_shards`;
    datagen's "Ray" flags)."""

    ray_address: str | None = None
    """Run the --num-shards shards as tasks on this Ray cluster ('ray start' address, or 'auto'),
    or 'local' to start Ray on this machine; needs pip install 'speculators-vllm016[ray]'."""
    ray_max_retries: int = 2
    """Times a failed or killed shard is started again (it resumes) before the run fails."""


_PARTS: dict[str, type] = {
    "engine": EngineOptions,
    "preprocessing": PreprocessingOptions,
    "output": OutputOptions,
}
# flag name (argparse dest) -> the part that holds it
_PART_OF: dict[str, str] = {item.name: part for part, cls in _PARTS.items() for item in fields(cls)}


class _FlagView:
    """`options.seq_length` reads and sets `options.preprocessing.seq_length`: the flat flag names
    of the one-dataclass options, kept for callers written against them."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, options: Any, owner: type | None = None) -> Any:
        if options is None:
            return self
        return getattr(getattr(options, self.part), self.name)

    def __set__(self, options: Any, value: Any) -> None:
        setattr(getattr(options, self.part), self.name, value)


@dataclass(init=False)
class DatagenOptions:
    """Every setting of a datagen run, as its three parts.

    Build it from parsed flags with `from_args`, from the parts, or from flag names as keywords
    (`DatagenOptions(target_model_path=..., train_data_path=..., output_dir=..., seq_length=...)`).
    """

    engine: EngineOptions
    preprocessing: PreprocessingOptions
    output: OutputOptions

    def __init__(
        self,
        engine: EngineOptions | None = None,
        preprocessing: PreprocessingOptions | None = None,
        output: OutputOptions | None = None,
        **flags: Any,
    ) -> None:
        parts = {"engine": engine, "preprocessing": preprocessing, "output": output}
        grouped: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        for name, value in flags.items():
            part = _PART_OF.get(name)
            if part is None:
                raise TypeError(f"DatagenOptions got an unknown flag {name!r}")
            if parts[part] is not None:
                raise TypeError(f"{name!r} given both as a flag and inside the {part} part")
            grouped[part][name] = value
        for part, cls in _PARTS.items():
            setattr(self, part, parts[part] if parts[part] is not None else cls(**grouped[part]))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> DatagenOptions:
        """The one builder from parsed flags: each field is `overrides[name]`, else the flag of
        that name where the parser has it (`--no-progress` gives `show_progress`), else its default.

        A parser that gives a flag of the same name another meaning (train's `--seed`,
        `--token-freq-path`, `--no-progress`) passes datagen's value as an override.
        """
        return cls.from_fields(vars(args), **overrides)

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], **overrides: Any) -> DatagenOptions:
        """`from_args` over any mapping of datagen's flag names; names that are not datagen's are
        ignored."""
        flags: dict[str, Any] = {}
        for name in _PART_OF:
            if name in overrides:
                flags[name] = overrides.pop(name)
            elif name == "show_progress" and "no_progress" in values:
                flags[name] = not values["no_progress"]
            elif name in values:
                flags[name] = values[name]
        if overrides:
            raise TypeError(f"not datagen options: {', '.join(sorted(overrides))}")
        return cls(**flags)

    def validate(self) -> None:
        """Every check the flags alone allow; a ValueError names the flag and what it needs."""
        engine, data, output = self.engine, self.preprocessing, self.output
        for flag, value in (
            ("--tensor-parallel-size", engine.tensor_parallel_size),
            ("--pipeline-parallel-size", engine.pipeline_parallel_size),
            ("--num-writer-threads", output.num_writer_threads),
            ("--num-preprocessing-workers", data.num_preprocessing_workers),
            ("--max-num-seqs", engine.max_num_seqs),
            ("--max-num-batched-tokens", engine.max_num_batched_tokens),
            ("--max-samples", data.max_samples),
        ):
            if value is not None and value < 1:
                raise InvalidInputError(f"{flag} must be at least 1, got {value}")
        if not 0 < engine.gpu_memory_utilization <= 1:
            raise InvalidInputError(
                f"--gpu-memory-utilization must be in (0, 1], got {engine.gpu_memory_utilization}"
            )
        if engine.dtype not in DTYPES:
            raise InvalidInputError(f"--dtype {engine.dtype!r} is not one of {', '.join(DTYPES)}")
        if data.assistant_pattern is not None:
            try:
                re.compile(data.assistant_pattern)
            except re.error as error:
                raise InvalidInputError(
                    f"--assistant-pattern is not a valid regular expression ({error})"
                ) from None
        data.template_kwargs()  # not a JSON object: refused here, before any work
        if output.num_shards < 1:
            raise InvalidInputError(f"--num-shards must be at least 1, got {output.num_shards}")
        if not 0 <= output.shard_index < output.num_shards:
            raise InvalidInputError(
                f"--shard-index must be in [0, {output.num_shards}), got {output.shard_index}"
            )
        if output.output_format not in SAMPLE_PATTERNS:
            raise InvalidInputError(f"--output-format must be one of {sorted(SAMPLE_PATTERNS)}")
        if output.storage_dtype not in STORAGE_DTYPES:
            raise InvalidInputError(
                f"--storage-dtype {output.storage_dtype!r} is not one of {', '.join(STORAGE_DTYPES)}"
            )
        if output.batch_size < 1:
            raise InvalidInputError(f"--batch-size must be at least 1, got {output.batch_size}")
        if data.seq_length < 1:
            raise InvalidInputError(f"--seq-length must be at least 1, got {data.seq_length}")
        if data.session_tokens < 0:
            raise InvalidInputError(
                f"--session-tokens must be 0 (no sessions) or more, got {data.session_tokens}"
            )
        if data.session_tokens > data.seq_length:
            raise InvalidInputError(
                f"--session-tokens {data.session_tokens} is over --seq-length {data.seq_length}: "
                "a session is never cut; raise --seq-length or lower --session-tokens"
            )
        if data.sessions_only and not data.session_tokens:
            raise InvalidInputError("--sessions-only needs --session-tokens N (N > 0)")
        if output.start_idx < 0:
            raise InvalidInputError(f"--start-idx must be non-negative, got {output.start_idx}")
        if engine.max_model_len is not None and engine.max_model_len <= data.seq_length:
            raise InvalidInputError(
                f"--max-model-len {engine.max_model_len} must exceed --seq-length "
                f"{data.seq_length} (vLLM keeps one position for the sampled token)"
            )

    @property
    def resolved_max_num_seqs(self) -> int:
        """The engine's batch: `--max-num-seqs`, else room for one extraction call (at least 32)."""
        if self.engine.max_num_seqs is not None:
            return self.engine.max_num_seqs
        return max(32, self.output.batch_size)

    @property
    def resolved_max_model_len(self) -> int:
        """The engine's context: `--max-model-len`, else the longest sample plus the sampled token."""
        if self.engine.max_model_len is not None:
            return self.engine.max_model_len
        return self.preprocessing.seq_length + 1


for _name, _part in _PART_OF.items():
    setattr(DatagenOptions, _name, _FlagView(_part, _name))
del _name, _part


def parse_template_kwargs(text: str | None) -> dict[str, Any]:
    """`--chat-template-kwargs` as a dict; anything but a JSON object is refused in one line."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidInputError(
            f"--chat-template-kwargs is not JSON ({error.msg}): {text!r}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
    return value
