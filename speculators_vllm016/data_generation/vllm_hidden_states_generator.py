"""Hidden states of a target model for every prompt token, computed by vLLM 0.16's engine.

The generator drives vLLM's engine pieces itself, the way `EngineCore` does: `engine_setup` builds
them once (a multiprocess executor whose workers carry `HiddenStatesWorkerExtension`, KV caches
sized from the workers' own memory profile, a `Scheduler`), and this module runs the step loop of
`schedule` -> `execute_model` -> `sample_tokens` -> `update_from_output`. Each prompt becomes one request with `max_tokens=1`: its prefill (chunked
when long) computes every prompt token, the worker copies the residual stream of the requested
layers into a shared-memory file per request, and the request finishes normally.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from speculators_vllm016.data_generation.engine_setup import (
    DEFAULT_MAX_NUM_SEQS,
    MIN_MAX_NUM_BATCHED_TOKENS,
    EngineSettings,
    HiddenStatesEngine,
    build_engine,
    shutdown_engine,
)
from speculators_vllm016.data_generation.transfer import TakenRequest, TransferDir
from speculators_vllm016.utils.errors import InvalidInputError, RunFailedError

__all__ = ["HiddenStatesResult", "VllmHiddenStatesGenerator"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiddenStatesResult:
    """The hidden states of one input sequence, as `generate_stream` yields them.

    It carries only what the engine computed; the loss mask belongs to the data pipeline, which
    builds its own sample from these fields (or calls `to_dict()` for 0.3.0's dict).
    """

    input_ids: torch.Tensor  # LongTensor [seq_len]
    hidden_states: list[torch.Tensor]  # one [seq_len, hidden_size] tensor per layer id, in order

    def to_dict(self) -> dict[str, Any]:
        """0.3.0's per-sequence dict: `input_ids`, `hidden_states` and `loss_mask=None`."""
        return {"input_ids": self.input_ids, "hidden_states": self.hidden_states, "loss_mask": None}


@dataclass(frozen=True)
class EngineStep:
    """What one engine step did, as `_run` needs it to tell progress from a stall."""

    num_scheduled_tokens: int  # tokens of the batch scheduled in this step (0: none)
    finished: list[Any]  # vLLM `EngineCoreOutput`s whose finish_reason is set
    num_tokens_in_flight: int = 0  # tokens of batches still executing after this step


def check_rows(request_id: str, num_tokens: int, layer_ids: list[int], taken: TakenRequest) -> None:
    """Every layer slot got exactly one row per token, as the capturing worker counted them."""
    if taken.rows_written == [num_tokens] * len(layer_ids):
        return
    wrong = [
        layer_ids[slot] for slot, count in enumerate(taken.rows_written) if count != num_tokens
    ]
    raise RuntimeError(
        f"request {request_id}: captured {sum(taken.rows_written)} rows, expected "
        f"{num_tokens * len(layer_ids)} ({num_tokens} tokens x {len(layer_ids)} layers); rows "
        f"per layer slot {taken.rows_written}, wrong for layers {wrong}"
    )


def _finished_outputs(engine_outputs: dict[int, Any]) -> list[Any]:
    return [
        output
        for outputs in engine_outputs.values()
        for output in outputs.outputs
        if output.finish_reason is not None
    ]


class VllmHiddenStatesGenerator:
    """Extracts the residual stream after chosen decoder layers for every prompt token.

    Example:
        with VllmHiddenStatesGenerator("meta-llama/Llama-3.1-8B-Instruct") as generator:
            results = generator.generate([[1, 2, 3], [4, 5]])
        results[0]["hidden_states"]  # list of [3, hidden_size] tensors, one per layer id

    Result `i` always belongs to input `i`. Sequences longer than `max_model_len` are refused with
    a `ValueError` (0.3.0 truncated them silently); nothing is ever truncated.
    """

    def __init__(
        self,
        model_path: str,
        layer_ids: list[int] | None = None,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.8,
        tensor_parallel_size: int = 1,
        *,
        dtype: str = "auto",
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
        pipeline_parallel_size: int = 1,
        trust_remote_code: bool = False,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = False,
        transfer_root: str | os.PathLike | None = None,
        max_transfer_bytes: int | None = None,
        target_config: dict | None = None,
    ) -> None:
        """`target_config`: the target's config.json where the caller read it already (datagen
        does, before it starts the engine); None: read here, once."""
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self._executor: Any = None
        self._transfer: TransferDir | None = None
        self._calls = itertools.count()
        self._finalizer: weakref.finalize | None = None
        if not enforce_eager:
            raise InvalidInputError(
                "enforce_eager=False is not supported: hidden states are captured by forward "
                "hooks on the decoder layers, which compiled graphs do not run"
            )
        if max_num_seqs < 1:
            raise InvalidInputError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(MIN_MAX_NUM_BATCHED_TOKENS, max_model_len)
        settings = EngineSettings(
            model_path=model_path,
            layer_ids=layer_ids,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            trust_remote_code=trust_remote_code,
            enable_prefix_caching=enable_prefix_caching,
            transfer_root=transfer_root,
            max_transfer_bytes=max_transfer_bytes,
            target_config=target_config,
        )
        self._adopt(build_engine(settings))  # what it started is shut down if it fails
        logger.info(
            "hidden-state generator ready: %s, layers %s of %d, hidden %d, %s, tp=%d pp=%d",
            self.model_path,
            self.layer_ids,
            self.num_hidden_layers,
            self.hidden_size,
            self.dtype,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
        )

    # -- start-up: the engine is built by `engine_setup` ----------------------------------------

    def _adopt(self, engine: HiddenStatesEngine) -> None:
        """Take over the built engine's pieces; from here `close()` shuts them down."""
        self._executor, self._transfer = engine.executor, engine.transfer
        self._finalizer = weakref.finalize(self, shutdown_engine, engine.executor, engine.transfer)
        self.vllm_config = engine.vllm_config
        self.num_hidden_layers = engine.num_hidden_layers
        self.hidden_size = engine.hidden_size
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.max_model_len
        # The scheduler never computes position max_model_len - 1 of a prompt (it is kept for the
        # sampled token), so a prompt of max_model_len tokens would never finish.
        self.max_sequence_length = self.max_model_len - 1
        self.dtype: torch.dtype = engine.dtype
        self.layer_ids = engine.layer_ids
        self.layer_path, self.model_class = engine.layer_path, engine.model_class
        self.max_transfer_bytes = engine.max_transfer_bytes
        self.num_kv_blocks, self.kv_block_size = engine.num_kv_blocks, engine.kv_block_size
        self._layout = engine.layout
        self._scheduler = engine.scheduler
        self._block_hasher = engine.block_hasher
        self._batch_queue_size = engine.batch_queue_size
        self._batch_queue: deque[tuple[Any, Any, Any]] | None = None
        self._step_fn = self._step
        if self._batch_queue_size > 1:
            self._batch_queue = deque(maxlen=self._batch_queue_size)
            self._step_fn = self._step_with_batch_queue

    # -- generation -------------------------------------------------------------------------------

    def _validate(self, token_ids: list[list[int]] | torch.Tensor) -> list[list[int]]:
        if self._executor is None:
            raise RuntimeError("this generator is closed")
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 2:
                raise InvalidInputError(
                    f"token_ids tensor must be 2-D [batch, seq_len], got shape "
                    f"{tuple(token_ids.shape)}"
                )
            sequences = token_ids.tolist()
        else:
            sequences = [
                ids.tolist() if isinstance(ids, torch.Tensor) else list(ids) for ids in token_ids
            ]
        if not sequences:
            raise InvalidInputError("token_ids is empty: pass at least one sequence")
        for index, ids in enumerate(sequences):
            if not ids:
                raise InvalidInputError(f"sequence {index} is empty")
            if len(ids) > self.max_sequence_length:
                raise InvalidInputError(
                    f"sequence {index} has {len(ids)} tokens; at most max_model_len - 1 = "
                    f"{self.max_sequence_length} fit (vLLM keeps one position for the sampled "
                    "token). Truncate it yourself or raise max_model_len"
                )
            if not all(type(token) is int for token in ids):  # fast path for plain ints
                for position, token in enumerate(ids):
                    if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                        raise InvalidInputError(
                            f"sequence {index} position {position}: token {token!r} is not an int"
                        )
                ids = sequences[index] = [int(token) for token in ids]  # e.g. numpy integers
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                position, token = next(
                    (p, t) for p, t in enumerate(ids) if not 0 <= t < self.vocab_size
                )
                raise InvalidInputError(
                    f"sequence {index} position {position}: token id {token} is outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        return sequences

    def generate(self, token_ids: list[list[int]] | torch.Tensor) -> list[dict]:
        """Hidden states for every token of every sequence, in input order.

        Returns one dict per input sequence: `input_ids` (LongTensor `[seq_len]`),
        `hidden_states` (list of `[seq_len, hidden_size]` tensors in `layer_ids` order, model
        dtype) and `loss_mask` (None; the data pipeline fills it).
        """
        sequences = self._validate(token_ids)
        results: list[dict | None] = [None] * len(sequences)
        for index, result in self._stream(sequences):
            results[index] = result.to_dict()
        return results  # type: ignore[return-value]

    def generate_stream(
        self, token_ids: list[list[int]] | torch.Tensor
    ) -> Iterator[tuple[int, HiddenStatesResult]]:
        """Like `generate`, but yields `(input index, HiddenStatesResult)` as each one finishes.

        All sequences are scheduled at once, so the engine stays full until the last one; a
        caller can write finished samples while the rest are still computing. Stopping the
        iteration early aborts what is left; the generator stays usable.
        """
        return self._stream(self._validate(token_ids))

    def _stream(self, sequences: list[list[int]]) -> Iterator[tuple[int, HiddenStatesResult]]:
        """Admit requests while their transfer files fit the budget; yield results as they end.

        Each admitted request's file is reserved in full (see `TransferDir.allocate`). When the
        transfer root is full, admission waits for this call's running requests to finish; with
        none running the call fails with a clear error instead of a SIGBUS in a worker.
        """
        from speculators_vllm016.data_generation.transfer import TransferSpaceError

        assert self._transfer is not None
        transfer = self._transfer
        call = next(self._calls)
        request_ids = [f"c{call}-{index}" for index in range(len(sequences))]
        index_of = {request_id: index for index, request_id in enumerate(request_ids)}
        waiting = deque(request_ids)
        in_flight: dict[str, int] = {}

        def admit() -> list[str]:
            added = []
            while waiting:
                request_id = waiting[0]
                ids = sequences[index_of[request_id]]
                nbytes = self._layout.file_bytes(len(ids))
                if in_flight and sum(in_flight.values()) + nbytes > self.max_transfer_bytes:
                    break
                try:
                    transfer.allocate(request_id, nbytes)
                except TransferSpaceError:
                    if in_flight:
                        break  # wait for running requests to free their space
                    raise
                waiting.popleft()
                in_flight[request_id] = nbytes
                self._scheduler.add_request(self._make_request(request_id, ids))
                added.append(request_id)
            return added

        try:
            pending = set(admit())
            for finished in self._run(pending, admit):
                for request_id in finished:
                    ids = sequences[index_of[request_id]]
                    taken = transfer.take(request_id, self._layout, len(ids))
                    in_flight.pop(request_id, None)
                    check_rows(request_id, len(ids), self.layer_ids, taken)
                    result = HiddenStatesResult(
                        input_ids=torch.tensor(ids, dtype=torch.long),
                        hidden_states=taken.hidden_states,
                    )
                    yield index_of[request_id], result
        except BaseException:
            self._recover(request_ids)
            raise

    def _make_request(self, request_id: str, ids: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            # Never serve a prompt token from the prefix cache: its hidden states would be lost.
            skip_reading_prefix_cache=True,
        )
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            pooling_params=None,
            eos_token_id=None,
            arrival_time=time.time(),
            block_hasher=self._block_hasher,
        )

    def _step(self) -> EngineStep:
        """One engine step, as `EngineCore.step`: schedule, execute, sample, update."""
        scheduler = self._scheduler
        scheduler_output = scheduler.schedule()
        future = self._executor.execute_model(scheduler_output, non_block=True)
        grammar_output = scheduler.get_grammar_bitmask(scheduler_output)
        model_output = future.result()
        if model_output is None:
            model_output = self._executor.sample_tokens(grammar_output)
        engine_outputs = scheduler.update_from_output(scheduler_output, model_output)
        return EngineStep(
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            finished=_finished_outputs(engine_outputs),
        )

    def _step_with_batch_queue(self) -> EngineStep:
        """One engine step with batches in flight, as `EngineCore.step_with_batch_queue`.

        Schedule a new batch while the queue has room and the oldest batch is still running;
        otherwise wait for the oldest batch and update the scheduler from its output. A
        request's next prefill chunk can be scheduled while its previous one is in flight
        (the scheduler advances `num_computed_tokens` when it schedules).
        """
        scheduler = self._scheduler
        batch_queue = self._batch_queue
        assert batch_queue is not None and len(batch_queue) < self._batch_queue_size
        scheduled_tokens = 0
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            exec_future = self._executor.execute_model(scheduler_output, non_block=True)
            scheduled_tokens = scheduler_output.total_num_scheduled_tokens
            if scheduled_tokens > 0:
                grammar_output = scheduler.get_grammar_bitmask(scheduler_output)
                future = self._executor.sample_tokens(grammar_output, non_block=True)
            else:
                future = exec_future  # nothing to sample
            batch_queue.appendleft((future, scheduler_output, exec_future))
            if (
                scheduled_tokens > 0
                and len(batch_queue) < self._batch_queue_size
                and not batch_queue[-1][0].done()
            ):
                return EngineStep(scheduled_tokens, [], self._tokens_in_flight())
        elif not batch_queue:
            return EngineStep(0, [])
        future, scheduler_output, exec_future = batch_queue.pop()
        model_output = future.result()
        if model_output is None:
            exec_future.result()  # raises the worker's error if execute_model failed
            raise RuntimeError("the last pipeline stage returned no output for a batch")
        engine_outputs = scheduler.update_from_output(scheduler_output, model_output)
        return EngineStep(
            scheduled_tokens, _finished_outputs(engine_outputs), self._tokens_in_flight()
        )

    def _tokens_in_flight(self) -> int:
        return sum(output.total_num_scheduled_tokens for _, output, _ in self._batch_queue or ())

    def _has_work(self) -> bool:
        return self._scheduler.has_requests() or bool(self._batch_queue)

    def _run(self, pending: set[str], refill=None) -> Iterator[list[str]]:
        """Step the engine until every pending request finished; yield each step's finishers.

        `refill()`, called after each yield, may admit more requests; they join `pending`.
        """
        from vllm.v1.engine import FinishReason

        idle_steps = 0
        while pending or self._has_work():
            step = self._step_fn()
            if (
                step.num_scheduled_tokens == 0
                and not step.finished
                and not step.num_tokens_in_flight
            ):
                idle_steps += 1
                if idle_steps > 2 and pending:
                    raise RunFailedError(
                        f"the scheduler stopped making progress with {len(pending)} requests "
                        "unfinished (KV cache too small for one sequence?)"
                    )
            else:
                idle_steps = 0
            done = []
            for output in step.finished:
                if output.request_id not in pending:
                    continue
                if output.finish_reason != FinishReason.LENGTH:
                    raise RuntimeError(
                        f"request {output.request_id} ended with {output.finish_reason!s} "
                        "instead of completing its prefill"
                    )
                pending.discard(output.request_id)
                done.append(output.request_id)
            if done:
                yield done
                if refill is not None:
                    pending.update(refill())

    def _recover(self, request_ids: list[str]) -> None:
        """Abort what is left of a failed call so the next call starts clean."""
        from vllm.v1.request import RequestStatus

        try:
            self._scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
            while self._has_work():
                self._step_fn()
            self._executor.collective_rpc("speculators_reset")
        except Exception:  # noqa: BLE001 - the original error is the one to report
            logger.exception("could not clean up after a failed generate() call")
        finally:
            if self._transfer is not None:
                for request_id in request_ids:
                    self._transfer.discard(request_id)

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def worker_died(self) -> bool:
        """A worker process exited unexpectedly (vLLM's worker monitor failed the executor)."""
        return bool(getattr(self._executor, "is_failed", False))

    def close(self) -> None:
        """Stop the worker processes and remove the transfer files; safe to call twice."""
        if self._finalizer is not None:
            self._finalizer()
        else:
            shutdown_engine(self._executor, self._transfer)
        self._executor = None
        self._transfer = None

    def __enter__(self) -> VllmHiddenStatesGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a destructor
            pass
