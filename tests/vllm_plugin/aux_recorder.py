"""Getting the plugin's EAGLE-3 aux states out of a real vLLM 0.16 engine on the CPU build.

The CPU model runner refuses speculative decoding, so nothing in it asks the model for aux states.
These functions run inside each worker (sent through the hidden-states generator's
`collective_rpc`) and do what vLLM's GPU runner does with an EAGLE-3 draft: call the model's own
`set_aux_hidden_state_layers`, then take the `(hidden_states, aux_states)` pair its forward
returns. The forward is wrapped on the instance so the runner still receives the plain hidden
states it expects; the aux rows of every scheduled step are filed per request with the row layout
the generator's worker extension computes for the same step (`_speculators_segments`), keyed by
the request's prompt. Each forward's final hidden states are also compared with vLLM's own
`DeepseekV2Model.forward` run on the same inputs, to show the plugin changes nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["collect", "install", "set_layers"]


def _inner_model(model: torch.nn.Module) -> torch.nn.Module:
    from speculators_vllm016.vllm_plugin.deepseek_eagle3 import Eagle3DeepseekV2Model

    found = [m for m in model.modules() if isinstance(m, Eagle3DeepseekV2Model)]
    assert len(found) == 1, f"{type(model).__name__} holds no plugin DeepSeek model"
    return found[0]


def install(worker: Any, aux_ids: list[int]) -> dict[str, Any]:
    """Set the aux layers through the model's interface and start recording; reports the classes."""
    from vllm.distributed import get_tp_group
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = worker.model_runner.model
    model.set_aux_hidden_state_layers(tuple(aux_ids))
    inner = _inner_model(model)
    worker._aux_record = {"rows": {}, "final_equal": [], "returned_pair": []}
    if not getattr(model, "_aux_recorder_wrapped", False):
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            return _record(worker, inner, output, kwargs)

        model.forward = forward
        model._aux_recorder_wrapped = True
    return {
        "model_class": type(model).__name__,
        "inner_class": type(inner).__name__,
        "supports_eagle3": bool(supports_eagle3(model)),
        "default_layers": tuple(model.get_eagle3_aux_hidden_state_layers()),
        "tp_rank": get_tp_group().rank_in_group,
    }


def set_layers(worker: Any, aux_ids: list[int]) -> None:
    worker.model_runner.model.set_aux_hidden_state_layers(tuple(aux_ids))
    worker._aux_record = {"rows": {}, "final_equal": [], "returned_pair": []}


def _record(worker: Any, inner: torch.nn.Module, output: Any, kwargs: dict[str, Any]) -> Any:
    from vllm.distributed import get_tp_group
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model

    state = worker._speculators_state
    record = worker._aux_record
    pair = isinstance(output, tuple)
    hidden_states, aux = output if pair else (output, None)
    if state is None or state.scheduler_output is None:
        return hidden_states  # a dummy forward, not a scheduled step
    record["returned_pair"].append(pair)
    scheduled, state.scheduler_output = state.scheduler_output, None  # generator's hooks stay off
    try:
        base = DeepseekV2Model.forward(
            inner, kwargs.get("input_ids"), kwargs["positions"], None, kwargs.get("inputs_embeds")
        )
    finally:
        state.scheduler_output = scheduled
    record["final_equal"].append(bool(torch.equal(hidden_states, base)))
    if aux is None or get_tp_group().rank_in_group != 0:
        return hidden_states
    segments = worker._speculators_segments(state)
    requests = worker.model_runner.requests
    for segment in segments:
        key = tuple(requests[segment.request_id].prompt_token_ids)
        seq_len = segment.mapped.rows.shape[1]
        rows = record["rows"].setdefault(
            key, torch.full((len(aux), seq_len, aux[0].shape[-1]), float("nan"))
        )
        for slot, states in enumerate(aux):
            chunk = states[segment.row : segment.row + segment.count]
            rows[slot, segment.start : segment.start + segment.count] = chunk.float().cpu()
    return hidden_states


def collect(worker: Any) -> dict[str, Any]:
    """What was recorded since `install`/`set_layers`: per-prompt aux rows and the per-step checks."""
    return dict(worker._aux_record)
