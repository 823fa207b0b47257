"""Worker extension that captures the residual stream after chosen decoder layers.

vLLM mixes this class into its worker (`ParallelConfig.worker_extension_cls`); the generator calls
its `speculators_*` methods through `collective_rpc`. Capture works by forward hooks on the decoder
layers, so it needs no per-architecture forward code and no `supports_eagle3` gate: any model whose
layers sit in a module list and return a tensor or `(hidden_states, residual)` is covered, DeepSeek
V2/V3 and Kimi-K2/K2.5 (layers nested in a multimodal wrapper) included.

Rows go into the per-request shared-memory files made by the driver (see `transfer.py`); for every
forward step, the model runner's own batch layout says which rows belong to which request and at
which positions. On a GPU the copies are asynchronous (`device_transfer.RowWriter`). When a
request's last prefill chunk has run, the worker waits for its rows to land and then writes its
row counts into the same file, before `execute_model` returns: the driver learns everything from
the file, with no extra round trip to the workers per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculators_vllm016.data_generation.device_transfer import RowTarget, RowWriter
from speculators_vllm016.data_generation.layer_capture import (
    find_decoder_layers,
    residual_scale,
    residual_stream,
)
from speculators_vllm016.data_generation.transfer import (
    MappedRequest,
    TransferLayout,
    map_request,
    request_file,
)

__all__ = ["CaptureSetup", "HiddenStatesWorkerExtension"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureSetup:
    """One worker's answer to `speculators_setup_capture` (pickled back through vLLM's queue)."""

    tp_rank: int
    captured_layers: list[int]  # decoder layer indices this worker hooked
    layer_path: str  # where the model keeps its decoder layers, e.g. "model.layers"
    model_class: str  # the vLLM model's class name


@dataclass
class _Segment:
    """Rows `[row, row + count)` of this step's batch are positions `[start, start + count)`."""

    request_id: str
    mapped: MappedRequest  # rows [num_layers, seq_len, hidden] and per-slot row counts
    row: int
    start: int
    count: int


@dataclass
class _CaptureState:
    layer_slots: dict[int, list[int]]  # decoder layer index -> its slots in a request's buffer
    owned_slots: list[int]  # the slots whose layers this worker hooked
    layout: TransferLayout
    transfer_dir: Path
    buffers: dict[str, MappedRequest] = field(default_factory=dict)
    rows_written: dict[str, list[int]] = field(default_factory=dict)  # per slot
    scheduler_output: Any = None  # the step being executed, None outside execute_model
    segments: list[_Segment] | None = None
    num_tokens: int = 0
    hooks: list[Any] = field(default_factory=list)
    writer: RowWriter = field(default_factory=RowWriter)


def native_mla_rope(model: torch.nn.Module) -> int:
    """On vLLM's CPU build, run plain RoPE of MLA attention through the PyTorch path.

    With `rope_scaling: null` a DeepSeek-V2/V3 model gets vLLM's plain `RotaryEmbedding`, whose
    CPU forward is a C++ op that reads the query as contiguous rows; MLA hands it the rope part
    of each head, a strided view, so the heads get the wrong positions and every hidden state
    after layer 0 is silently wrong. `forward_native` handles strided views. Returns how many
    rotary modules were switched.
    """
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    switched: set[int] = set()
    for module in model.modules():
        rope = getattr(module, "rotary_emb", None)
        if type(rope) is RotaryEmbedding and hasattr(module, "qk_nope_head_dim"):
            if id(rope) not in switched:
                rope._forward_method = rope.forward_native
                switched.add(id(rope))
    if switched:
        logger.info(
            "MLA with plain RoPE on CPU: %d rotary modules use the native path", len(switched)
        )
    return len(switched)


class HiddenStatesWorkerExtension:
    """Methods mixed into vLLM's worker for hidden-state capture."""

    _speculators_state: _CaptureState | None = None

    def speculators_setup_capture(
        self,
        layer_ids: list[int],
        num_hidden_layers: int,
        hidden_size: int,
        dtype: str,
        transfer_dir: str,
    ) -> CaptureSetup:
        """Hook the requested layers this rank holds; report which ones that is.

        With tensor parallelism every rank holds the full residual stream, so only TP rank 0
        captures. With pipeline parallelism each stage captures the layers it owns.
        """
        from vllm.distributed import get_tp_group

        self.speculators_teardown()
        model = self.model_runner.model  # type: ignore[attr-defined]
        native_mla_rope(model)
        layers = find_decoder_layers(model, num_hidden_layers)
        tp_rank = get_tp_group().rank_in_group
        torch_dtype = getattr(torch, dtype)
        slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(layer_ids):
            slots.setdefault(layer, []).append(slot)
        captured = [i for i in slots if i in layers.owned] if tp_rank == 0 else []
        state = _CaptureState(
            layer_slots=slots,
            owned_slots=sorted(slot for layer in captured for slot in slots[layer]),
            layout=TransferLayout.of(len(layer_ids), hidden_size, torch_dtype),
            transfer_dir=Path(transfer_dir),
        )
        for layer_index in captured:
            layer = layers.layers[layer_index]
            scale = residual_scale(layer, torch_dtype)
            state.hooks.append(
                layer.register_forward_hook(self._speculators_make_hook(layer_index, scale))
            )
        self._speculators_state = state
        self._speculators_wrap_runner()
        logger.info(
            "hidden-state capture: %s layers %s on tp rank %d (layer list %s)",
            type(model).__name__,
            captured,
            tp_rank,
            layers.path,
        )
        return CaptureSetup(
            tp_rank=tp_rank,
            captured_layers=captured,
            layer_path=layers.path,
            model_class=type(model).__name__,
        )

    def speculators_reset(self) -> None:
        """Forget every open buffer (after a failed call on the driver)."""
        state = self._speculators_state
        if state is not None:
            try:
                state.writer.flush()
            except RuntimeError:
                logger.exception("discarding a failed hidden-state copy")
            state.buffers.clear()
            state.rows_written.clear()
            state.scheduler_output = None
            state.segments = None

    def speculators_teardown(self) -> None:
        state = self._speculators_state
        if state is None:
            return
        for handle in state.hooks:
            handle.remove()
        state.writer.close()
        self._speculators_state = None

    # -- internals ---------------------------------------------------------------------------

    def _speculators_wrap_runner(self) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "_speculators_wrapped", False):
            return
        original = runner.execute_model
        extension = self

        def execute_model(scheduler_output, *args, **kwargs):
            state = extension._speculators_state
            if state is None:
                return original(scheduler_output, *args, **kwargs)
            state.scheduler_output = scheduler_output
            state.segments = None
            try:
                output = original(scheduler_output, *args, **kwargs)
                extension._speculators_publish_finished(state)
                return output
            finally:
                state.scheduler_output = None
                state.segments = None

        runner.execute_model = execute_model
        runner._speculators_wrapped = True

    def _speculators_make_hook(self, layer_index: int, scale: float):
        def hook(module, args, output):
            state = self._speculators_state
            if state is None or state.scheduler_output is None:
                return  # a profiling or dummy forward, not a scheduled step
            segments = self._speculators_segments(state)
            if not segments:
                return
            stream = residual_stream(output)[: state.num_tokens]
            if scale != 1.0:
                stream = stream * scale
            layer_slots = state.layer_slots[layer_index]
            targets = []
            for segment in segments:
                end = segment.start + segment.count
                written = state.rows_written[segment.request_id]
                for slot in layer_slots:
                    destination = segment.mapped.rows[slot, segment.start : end]
                    targets.append(RowTarget(destination, segment.row, segment.count))
                    written[slot] += segment.count
            # On a GPU this only enqueues an async copy; the forward pass goes on at once.
            state.writer.write_rows(stream, targets)

        return hook

    def _speculators_segments(self, state: _CaptureState) -> list[_Segment]:
        """This step's row layout, built once per forward from the runner's batch order."""
        if state.segments is not None:
            return state.segments
        out = state.scheduler_output
        runner = self.model_runner  # type: ignore[attr-defined]
        starts: dict[str, int] = {}
        for new_request in out.scheduled_new_reqs:
            starts[new_request.req_id] = new_request.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for request_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            starts[request_id] = computed
        batch = runner.input_batch
        order = [rid for rid in batch.req_ids[: batch.num_reqs] if rid is not None]
        if sorted(order) != sorted(out.num_scheduled_tokens):
            raise RuntimeError(
                "hidden-state capture: the runner's batch does not match the scheduled requests"
            )
        segments: list[_Segment] = []
        row = 0
        for request_id in order:
            count = out.num_scheduled_tokens[request_id]
            mapped = state.buffers.get(request_id)
            if mapped is None:
                path = request_file(state.transfer_dir, request_id)
                mapped = state.buffers[request_id] = map_request(path, state.layout)
                state.rows_written[request_id] = [0] * state.layout.num_layers
            start = starts[request_id]
            seq_len = mapped.rows.shape[1]
            if start + count > seq_len:
                raise RuntimeError(
                    f"hidden-state capture: request {request_id} scheduled positions "
                    f"{start}..{start + count} beyond its {seq_len} prompt tokens"
                )
            segments.append(
                _Segment(request_id=request_id, mapped=mapped, row=row, start=start, count=count)
            )
            row += count
        if row != out.total_num_scheduled_tokens:
            raise RuntimeError(
                f"hidden-state capture: {row} rows laid out, "
                f"{out.total_num_scheduled_tokens} tokens scheduled"
            )
        state.num_tokens = row
        state.segments = segments
        return segments

    def _speculators_publish_finished(self, state: _CaptureState) -> None:
        """Hand over the requests whose prefill this step completed: rows first, then counts.

        The counts are written only once every row of the request is in shared memory, and
        before `execute_model` returns; the driver reads them after the step's output, so it
        never sees a count ahead of its rows. Each worker writes only the slots it captures.
        """
        done = [
            segment
            for segment in state.segments or ()
            if segment.start + segment.count == segment.mapped.rows.shape[1]
        ]
        if not done:
            return
        state.writer.flush()
        for segment in done:
            state.buffers.pop(segment.request_id, None)
            written = state.rows_written.pop(segment.request_id)
            for slot in state.owned_slots:
                segment.mapped.counts[slot] = written[slot]
