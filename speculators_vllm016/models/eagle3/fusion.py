"""The draft's fusion of the target's auxiliary hidden states: optional norms, then `fc`.

EAGLE-3 concatenates the auxiliary states and projects them with `fc`. Two optional norms sit in
front of it, both named as upstream speculators 0.7 and vLLM >= 0.22 name them:
`norm_before_fc` (one RMSNorm over the whole concatenation, weight `input_norm.weight`) and
EAGLE-3.1's `fc_norm` (one RMSNorm per auxiliary state, weights `fc_norm.<i>.weight`, applied to
each state's slice before the concatenation is projected). A late target layer's activations
are often an order of magnitude larger than an early one's; normed per state, each contributes
on the same scale. With neither switch the fusion is `fc` alone, as before they existed.
"""

from __future__ import annotations

import torch
from torch import nn

from speculators_vllm016.utils.eagle31 import normalize_aux_states

__all__ = ["fuse_aux_states", "fusion_norms"]


def fusion_norms(
    norm_class: type[nn.Module],
    state_size: int,
    count: int,
    eps: float,
    *,
    norm_before_fc: bool,
    fc_norm: bool,
) -> tuple[nn.Module | None, nn.ModuleList | None]:
    """`(input_norm, fc_norm)` for a draft fusing `count` states of `state_size` each; None for a
    switch that is off (no parameter is made, so an EAGLE-3 draft's weights are unchanged)."""
    input_norm = norm_class(count * state_size, eps=eps) if norm_before_fc else None
    per_state = (
        nn.ModuleList(norm_class(state_size, eps=eps) for _ in range(count)) if fc_norm else None
    )
    return input_norm, per_state


def fuse_aux_states(
    states: torch.Tensor,
    fc: nn.Linear,
    input_norm: nn.Module | None,
    fc_norm: nn.ModuleList | None,
) -> torch.Tensor:
    """The draft's fused state: `fc` of the normalized auxiliary states."""
    return fc(normalize_aux_states(states, input_norm, fc_norm))
