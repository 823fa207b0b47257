"""EAGLE-3.1's config keys and the fusion norms' arithmetic, shared by our draft and the vLLM
plugin's draft class (which uses vLLM's own norm modules).

Upstream speculators 0.7 writes the switches at the top level of a draft's `config.json`; vLLM
>= 0.22 reads them from there:
- `norm_before_fc`: one RMSNorm over the concatenated auxiliary states before `fc`
  (`input_norm.weight`);
- `fc_norm`: one RMSNorm per auxiliary state, on its own slice, before `fc`
  (`fc_norm.<i>.weight`);
- `norm_output`: each draft step hands the next its state after the final norm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["EAGLE31_FIELDS", "normalize_aux_states"]

# A config with all of them off is written without them (an EAGLE-3 config stays as it was).
EAGLE31_FIELDS = ("norm_before_fc", "fc_norm", "norm_output")


def normalize_aux_states(
    states: torch.Tensor,
    input_norm: Callable[[torch.Tensor], torch.Tensor] | None,
    fc_norm: Sequence[Callable[[torch.Tensor], torch.Tensor]] | None,
) -> torch.Tensor:
    """`states` `[..., count * width]` as `fc` reads them: through whichever norm is set (the
    config forbids both), `fc_norm[i]` on the i-th state's slice."""
    if input_norm is not None:
        states = input_norm(states)
    if fc_norm is not None:
        slices = states.chunk(len(fc_norm), dim=-1)
        states = torch.cat([norm(part) for norm, part in zip(fc_norm, slices, strict=True)], -1)
    return states
