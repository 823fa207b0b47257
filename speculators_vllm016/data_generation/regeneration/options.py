"""What a regeneration run is asked to do: sampling, chat template, limits, shards, engine.

The fields are the flags of `speculators regenerate --help` without the dashes. Sampling fields
left as None take the model's `generation_config.json` value, as `vllm serve` does, so the
in-process engine and a server started on the same model sample alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "REASONING_MODES",
    "TOOL_ROW_MODES",
    "RegenerateOptions",
    "SamplingOptions",
    "refuse_beyond_model_context",
]

# The flags only one kind of engine uses, by field name.
ENGINE_FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "dtype": "--dtype",
    "max_num_seqs": "--max-num-seqs",
}
SERVER_FLAGS = {
    "endpoint_model": "--endpoint-model",
    "concurrency": "--concurrency",
    "request_timeout": "--request-timeout",
    "retries": "--retries",
}
REASONING_MODES = ("keep", "drop")
TOOL_ROW_MODES = ("skip", "keep")


@dataclass(frozen=True)
class SamplingOptions:
    """How each response is sampled; None: the model's generation config, else vLLM's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int = 2048
    seed: int = 0
    """Each turn's own seed is drawn from (seed, row, turn), whatever batch the turn is in."""

    def to_json(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }


@dataclass
class RegenerateOptions:
    """One regeneration job (one shard of it)."""

    target_model_path: str
    train_data_path: str
    output_dir: str
    """Folder for conversations.jsonl."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: str = "keep"
    """keep: the response as generated, thinking block included; drop: only what follows it."""
    tool_rows: str = "skip"
    """Rows with tool calls: skip (listed and counted) or keep (copied unchanged, counted)."""
    max_prompt_tokens: int = 4096
    max_samples: int | None = None
    num_shards: int = 1
    """Shards of the whole job."""
    shard_index: int = 0
    """This process's shard."""
    batch_size: int = 256
    """Rows whose turns are generated together (a crash loses at most these)."""
    endpoint: str | None = None
    """Base URL of a running OpenAI-compatible server (e.g. vllm serve) to ask instead of vLLM in
    this process; --target-model-path still gives the tokenizer and chat template."""
    endpoint_model: str | None = None
    """Served model name (if several)."""
    concurrency: int = 64
    """Requests in flight."""
    request_timeout: float = 600.0
    """Seconds."""
    retries: int = 4
    """Retries with backoff."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    """None: max_prompt_tokens + max_tokens, so no response is cut short by the context."""
    gpu_memory_utilization: float = 0.8
    dtype: str = "auto"
    max_num_seqs: int = 256
    trust_remote_code: bool = False
    hf_cache_dir: str | None = None
    num_preprocessing_workers: int = 8
    fsync: bool = False
    """fsync every finished row."""
    target_config: dict | None = field(default=None, repr=False, compare=False)
    """Not a flag: the target's config.json where the command read it already (to fit the
    lengths to its context); the engine's start uses it instead of reading it again."""
    show_progress: bool = field(default=True, metadata={"flag": "--no-progress"})
    """Show the progress bar; `--no-progress` hides it."""

    @property
    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return self.max_prompt_tokens + self.sampling.max_tokens

    def validate(self) -> None:
        """Every check the flags alone allow; a ValueError names the flag and what it needs."""
        sampling = self.sampling
        for flag, value in (
            ("--max-tokens", sampling.max_tokens),
            ("--max-prompt-tokens", self.max_prompt_tokens),
            ("--max-samples", self.max_samples),
            ("--num-shards", self.num_shards),
            ("--batch-size", self.batch_size),
            ("--concurrency", self.concurrency),
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--num-preprocessing-workers", self.num_preprocessing_workers),
        ):
            if value is not None and value < 1:
                raise InvalidInputError(f"{flag} must be at least 1, got {value}")
        if not 0 <= self.shard_index < self.num_shards:
            raise InvalidInputError(
                f"--shard-index must be in [0, {self.num_shards}), got {self.shard_index}"
            )
        if sampling.temperature is not None and sampling.temperature < 0:
            raise InvalidInputError(f"--temperature must be 0 or more, got {sampling.temperature}")
        if sampling.top_p is not None and not 0 < sampling.top_p <= 1:
            raise InvalidInputError(f"--top-p must be in (0, 1], got {sampling.top_p}")
        if sampling.top_k is not None and sampling.top_k < -1:
            raise InvalidInputError(
                f"--top-k must be -1 or 0 (off) or a count, got {sampling.top_k}"
            )
        if self.reasoning not in REASONING_MODES:
            raise InvalidInputError(f"--reasoning must be one of {', '.join(REASONING_MODES)}")
        if self.tool_rows not in TOOL_ROW_MODES:
            raise InvalidInputError(f"--tool-rows must be one of {', '.join(TOOL_ROW_MODES)}")
        if self.retries < 0:
            raise InvalidInputError(f"--retries must be 0 or more, got {self.retries}")
        if self.request_timeout <= 0:
            raise InvalidInputError(
                f"--request-timeout must be positive, got {self.request_timeout}"
            )
        if self.resolved_max_model_len <= self.max_prompt_tokens:
            raise InvalidInputError(
                f"--max-model-len {self.max_model_len} leaves no room for a response after a "
                f"prompt of --max-prompt-tokens {self.max_prompt_tokens}"
            )
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise InvalidInputError(
                f"--endpoint must be an http:// or https:// URL, got {self.endpoint!r}"
            )
        self._refuse_unused_engine_flags()

    def _refuse_unused_engine_flags(self) -> None:
        """With --endpoint the server is the engine: a flag of the in-process engine would do
        nothing (and without --endpoint, a server flag would): refused, naming them."""
        defaults = {f.name: f.default for f in fields(self)}
        engine = ENGINE_FLAGS if self.endpoint is not None else SERVER_FLAGS
        given = [flag for name, flag in engine.items() if getattr(self, name) != defaults[name]]
        if given and self.endpoint is not None:
            raise InvalidInputError(
                f"{', '.join(given)}: in-process engine flags, unused with --endpoint (the "
                "server runs with its own settings); leave them out"
            )
        if given:
            raise InvalidInputError(
                f"{', '.join(given)}: flags of --endpoint (a server), unused by the in-process "
                "engine; add --endpoint URL or leave them out"
            )


def refuse_beyond_model_context(
    max_model_len: int, config_dict: dict[str, Any], spare: int = 0
) -> None:
    """A context longer than the model's (no RoPE scaling to stretch it) refused in one line
    naming the flags, before vLLM refuses it in a validation error that names neither.

    `spare`: positions past the model's context the engine may be given. Datagen's engine takes
    one (`engine_setup.engine_config_of`): it holds the token sampled after a sample of the
    model's whole context, which no model ever runs."""
    from speculators_vllm016.utils.text_config import text_config_of

    text = text_config_of(config_dict)
    limit = text.get("max_position_embeddings")
    if isinstance(limit, int) and not text.get("rope_scaling") and max_model_len > limit + spare:
        raise InvalidInputError(
            f"the engine context of {max_model_len} tokens (--max-prompt-tokens + --max-tokens, "
            f"or --max-model-len) is longer than the model's {limit}; lower them"
        )
