"""Building the engine the hidden-states generator drives, apart from driving it.

As vLLM's `EngineCore` keeps construction (`__init__`: executor, KV caches, scheduler) apart from
`step()`, this module builds every piece once: engine arguments -> `VllmConfig` -> a multiprocess
executor whose workers carry `HiddenStatesWorkerExtension` -> KV caches sized from the workers'
own memory profile -> `Scheduler` and block hasher -> capture hooks in the workers. The generator
(`vllm_hidden_states_generator`) only runs requests through what `build_engine` returns.

vLLM is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from speculators_vllm016.data_generation.cpu_defaults import (
    cpu_defaults_applied,
    cpu_vector_flags,
    is_cpu_platform,
    slow_cpu_dtype_warning,
)
from speculators_vllm016.data_generation.transfer import TransferDir, TransferLayout
from speculators_vllm016.utils.errors import library_refusals_as_ours
from speculators_vllm016.utils.layer_ids import default_layer_ids, normalize_layer_ids

if TYPE_CHECKING:
    from speculators_vllm016.data_generation.custom_worker import CaptureSetup

__all__ = [
    "DEFAULT_MAX_NUM_SEQS",
    "MIN_MAX_NUM_BATCHED_TOKENS",
    "TEXT_ONLY_MODALITIES",
    "WORKER_EXTENSION",
    "EngineSettings",
    "HiddenStatesEngine",
    "build_engine",
    "engine_config_of",
    "setup_capture",
    "shutdown_engine",
]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "speculators_vllm016.data_generation.custom_worker.HiddenStatesWorkerExtension"
DEFAULT_MAX_NUM_SEQS = 32
MIN_MAX_NUM_BATCHED_TOKENS = 8192
TEXT_ONLY_MODALITIES = ("image", "video", "audio", "vision_chunk")


@dataclass(frozen=True)
class EngineSettings:
    """What the generator was asked for (its constructor's arguments, defaults resolved)."""

    model_path: str
    layer_ids: list[int] | None  # None: 0.3.0's defaults for the model's depth
    max_model_len: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    trust_remote_code: bool
    enable_prefix_caching: bool
    transfer_root: str | os.PathLike | None
    max_transfer_bytes: int | None  # None: half the free room of the transfer root
    target_config: dict | None = None
    """The target's config.json as the caller read it (datagen's `preflight.ModelFacts`): not
    read again here. None: `build_engine` reads it once (the generator used on its own)."""


@dataclass
class HiddenStatesEngine:
    """The built engine: what the step loop drives and what callers may read about the model."""

    vllm_config: Any
    executor: Any
    scheduler: Any
    block_hasher: Callable[[Any], list] | None  # built only with prefix caching (or a KV connector)
    batch_queue_size: int  # batches in flight at once (> 1 with pipeline parallelism)
    transfer: TransferDir
    layout: TransferLayout
    max_transfer_bytes: int
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    layer_ids: list[int]  # resolved: defaults filled in, negative ids counted from the end
    num_kv_blocks: int
    kv_block_size: int
    layer_path: str  # where the capturing workers found the decoder layers
    model_class: str


def shutdown_engine(executor: Any, transfer: TransferDir | None) -> None:
    """Stop the workers and remove the transfer files; never raises (it runs at exit too)."""
    if executor is not None:
        try:
            executor.shutdown()
        except Exception:  # noqa: BLE001 - shutdown must not raise at interpreter exit
            logger.exception("error while shutting down the vLLM executor")
    if transfer is not None:
        transfer.cleanup()


def engine_args_of(settings: EngineSettings) -> Any:
    """vLLM's `EngineArgs` for hidden-state extraction: eager, chunked prefill, text only."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=settings.model_path,
        # Multimodal wrappers (Kimi-K2.5) build their processing info from the tokenizer at
        # start-up, so it is loaded even though requests arrive as token ids.
        skip_tokenizer_init=False,
        # Text-only: a multimodal model's encoders are never built (keys a model does not
        # have are ignored).
        limit_mm_per_prompt=dict.fromkeys(TEXT_ONLY_MODALITIES, 0),
        trust_remote_code=settings.trust_remote_code,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        distributed_executor_backend="mp",
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_chunked_prefill=True,
        enable_prefix_caching=settings.enable_prefix_caching,
        async_scheduling=False,
        enforce_eager=True,
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
    )


def build_engine(settings: EngineSettings) -> HiddenStatesEngine:
    """Config, workers, KV caches, scheduler and capture hooks, in the order vLLM needs.

    On the CPU build, thread and memory defaults are applied while the workers start. If any
    step fails, what was already started (workers, transfer folder) is shut down again.
    """
    config_dict = settings.target_config
    if config_dict is None:
        from transformers import PretrainedConfig

        config_dict, _ = PretrainedConfig.get_config_dict(settings.model_path)
    world_size = settings.tensor_parallel_size * settings.pipeline_parallel_size
    engine_args = engine_args_of(settings)
    defaults = (
        cpu_defaults_applied(world_size, config_dict) if is_cpu_platform() else nullcontext({})
    )
    with defaults as chosen:
        for name, value in chosen.items():
            logger.info("vLLM CPU build: %s=%s (set it yourself to override)", name, value)
        # vLLM checks the settings (max_model_len, memory for the KV cache) as the engine starts.
        with library_refusals_as_ours():
            return _build(engine_args, settings)


# vLLM's switch for a max_model_len past the model's context (vllm/envs.py).
_LONG_CONTEXT_SWITCH = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@contextmanager
def _longer_context_allowed() -> Iterator[None]:
    """vLLM's refusal of a context past the model's switched off for the block (its own switch,
    read afresh: a cached reading is dropped), and put back as it was after it."""
    import vllm.envs as envs

    was_cached = hasattr(envs.__getattr__, "cache_clear")
    before = os.environ.get(_LONG_CONTEXT_SWITCH)
    os.environ[_LONG_CONTEXT_SWITCH] = "1"
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_LONG_CONTEXT_SWITCH, None)
        else:
            os.environ[_LONG_CONTEXT_SWITCH] = before
        if was_cached:
            envs.enable_envs_cache()


def engine_config_of(engine_args: Any) -> Any:
    """The `VllmConfig`, with room for a sample as long as the model's whole context.

    A prompt's last position is never computed by vLLM's scheduler (position max_model_len - 1
    is kept for the token sampled after it), so a sample of N tokens needs max_model_len N + 1,
    and vLLM refuses that when N is the model's context. The extra position is only ever the
    sampled token's: no model runs it (every request samples one token and ends). So the
    config is built with vLLM's refusal off, then vLLM's own rule is applied to one position
    less; a context more than one past the model's is refused in vLLM's words.
    """
    with _longer_context_allowed():
        vllm_config = engine_args.create_engine_config()
    model_config = vllm_config.model_config
    asked = int(model_config.max_model_len)
    try:
        model_config.get_and_verify_max_len(asked - 1)
    except ValueError:
        model_config.get_and_verify_max_len(asked)  # raises vLLM's message for what was asked
    return vllm_config


def _build(engine_args: Any, settings: EngineSettings) -> HiddenStatesEngine:
    vllm_config = engine_config_of(engine_args)
    model_config = vllm_config.model_config
    num_hidden_layers = int(model_config.hf_text_config.num_hidden_layers)
    hidden_size = int(model_config.get_hidden_size())
    dtype: torch.dtype = model_config.dtype
    if is_cpu_platform():
        warning = slow_cpu_dtype_warning(dtype, cpu_vector_flags())
        if warning:
            logger.warning(warning)
    layer_ids = normalize_layer_ids(
        default_layer_ids(num_hidden_layers) if settings.layer_ids is None else settings.layer_ids,
        num_hidden_layers,
    )
    layout = TransferLayout.of(len(layer_ids), hidden_size, dtype)
    transfer = TransferDir(settings.transfer_root)
    executor = None
    try:
        # Bytes of transfer files in flight at once: half the room there is, unless told.
        max_transfer_bytes = settings.max_transfer_bytes or max(1, transfer.free_bytes() // 2)
        executor = _make_executor(vllm_config)
        scheduler, block_hasher, num_kv_blocks, kv_block_size = _init_scheduler(
            vllm_config, executor
        )
        setup = setup_capture(executor, layer_ids, num_hidden_layers, hidden_size, dtype, transfer)
    except BaseException:
        shutdown_engine(executor, transfer)
        raise
    return HiddenStatesEngine(
        vllm_config=vllm_config,
        executor=executor,
        scheduler=scheduler,
        block_hasher=block_hasher,
        # As `EngineCore.__init__`: with pipeline parallelism several batches are in flight at
        # once (one per stage), so that no stage waits for the driver between batches.
        batch_queue_size=int(executor.max_concurrent_batches),
        transfer=transfer,
        layout=layout,
        max_transfer_bytes=max_transfer_bytes,
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        vocab_size=int(model_config.get_vocab_size()),
        max_model_len=int(model_config.max_model_len),
        dtype=dtype,
        layer_ids=layer_ids,
        num_kv_blocks=num_kv_blocks,
        kv_block_size=kv_block_size,
        layer_path=setup.layer_path,
        model_class=setup.model_class,
    )


def _make_executor(vllm_config: Any) -> Any:
    from vllm.v1.executor import Executor

    executor_class = Executor.get_class(vllm_config)
    return executor_class(vllm_config)


def _init_scheduler(config: Any, executor: Any) -> tuple[Any, Any, int, int]:
    """KV caches, scheduler and block hasher, exactly as `EngineCore.__init__` makes them.

    Returns `(scheduler, block_hasher or None, KV blocks, block size in tokens)`.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    kv_cache_specs = executor.get_kv_cache_specs()
    if any(kv_cache_specs):
        available = executor.determine_available_memory()
    else:
        available = [0] * len(kv_cache_specs)
    kv_cache_configs = get_kv_cache_configs(config, kv_cache_specs, available)
    scheduler_kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    executor.initialize_from_config(kv_cache_configs)
    config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
    config.cache_config.num_cpu_blocks = 0
    executor.collective_rpc("initialize_cache", args=(scheduler_kv_cache_config.num_blocks, 0))

    parallel = config.parallel_config
    block_size = (
        config.cache_config.block_size
        * parallel.decode_context_parallel_size
        * parallel.prefill_context_parallel_size
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=scheduler_kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        include_finished_set=False,
        log_stats=False,
    )
    block_hasher = None
    if config.cache_config.enable_prefix_caching or config.kv_transfer_config is not None:
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        block_hasher = get_request_block_hasher(block_size, hash_fn)
    return scheduler, block_hasher, scheduler_kv_cache_config.num_blocks, block_size


def setup_capture(
    executor: Any,
    layer_ids: list[int],
    num_hidden_layers: int,
    hidden_size: int,
    dtype: torch.dtype,
    transfer: TransferDir,
) -> CaptureSetup:
    """Hooks in every worker; each requested layer must be captured by exactly one of them."""
    replies = executor.collective_rpc(
        "speculators_setup_capture",
        args=(
            layer_ids,
            num_hidden_layers,
            hidden_size,
            str(dtype).removeprefix("torch."),
            str(transfer.path),
        ),
    )
    setups: list[CaptureSetup] = list(replies)
    owners: dict[int, int] = {}
    for setup in setups:
        for layer in setup.captured_layers:
            owners[layer] = owners.get(layer, 0) + 1
    wrong = sorted({layer for layer in layer_ids if owners.get(layer) != 1})
    if wrong:
        raise RuntimeError(
            f"layers {wrong} of {setups[0].model_class} were not captured by exactly one "
            f"worker (captures per layer: {owners})"
        )
    return setups[0]
