"""An optimizer's state keyed by parameter name: what a checkpoint stores, whatever the layout.

A plain `optimizer.state_dict()` numbers the parameters; a checkpoint keyed by their names loads
into an FSDP2-sharded run as into a single-process one (FSDP's full state dict uses names too),
and a parameter the model lacks is an error, not a silent shift. 0.3.0's single-process files,
keyed by number, still load.
"""

from __future__ import annotations

import torch

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["load_named_optimizer_state", "named_optimizer_state"]


def named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name (the layout FSDP's full state dict uses)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    raw = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    groups = []
    for live, saved in zip(optimizer.param_groups, raw["param_groups"], strict=True):
        group_names = [names[id(parameter)] for parameter in live["params"]]
        index_to_name.update(zip(saved["params"], group_names, strict=True))
        group = {key: value for key, value in saved.items() if key not in ("params", "param_names")}
        group["params"] = group_names
        groups.append(group)
    state = {index_to_name[index]: value for index, value in raw["state"].items()}
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, named: dict
) -> None:
    """Load a name-keyed state (ours) or an index-keyed one (0.3.0's single-GPU files)."""
    if named["state"] and all(isinstance(key, int) for key in named["state"]):
        optimizer.load_state_dict(named)
        return
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    current = optimizer.state_dict()
    name_to_index: dict[str, int] = {}
    for live, saved in zip(optimizer.param_groups, current["param_groups"], strict=True):
        name_to_index.update(
            zip((names[id(p)] for p in live["params"]), saved["params"], strict=True)
        )
    if len(named["param_groups"]) != len(current["param_groups"]):
        raise InvalidInputError(
            "the checkpoint's optimizer has a different number of parameter groups"
        )
    groups = []
    for loaded, saved in zip(named["param_groups"], current["param_groups"], strict=True):
        group = {key: value for key, value in loaded.items() if key != "params"}
        group["params"] = saved["params"]
        if "param_names" in saved:
            group["param_names"] = saved["param_names"]
        groups.append(group)
    missing = [name for name in named["state"] if name not in name_to_index]
    if missing:
        raise InvalidInputError(
            f"optimizer state for parameters the model does not have: {missing[:5]}"
        )
    state = {name_to_index[name]: value for name, value in named["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
