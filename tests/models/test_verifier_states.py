"""`ResidualStreamStates`: the verifier's hidden states numbered as vLLM's EAGLE-3 aux ids, so
id N (N decoder layers) is the last layer's output before the final norm, as the plugin captures
it and drafts are trained on (transformers' last `output_hidden_states` entry is after the norm).
"""

from __future__ import annotations

import torch

from speculators_vllm016.models.verifier_lm import load_verifier_lm
from speculators_vllm016.models.verifier_states import ResidualStreamStates


def test_the_last_state_is_the_last_layer_output_before_the_final_norm(tiny_deepseek_v3):
    verifier = load_verifier_lm(str(tiny_deepseek_v3), torch.float32).eval()
    ids = torch.tensor([[5, 17, 300, 42, 8]])
    with torch.no_grad(), ResidualStreamStates(verifier) as streams:
        output = verifier(ids, output_hidden_states=True)
        states = streams.of(output)
        layers = verifier.model.layers
        assert len(states) == len(layers) + 1
        for index in range(len(layers)):  # ids 0..N-1: transformers' entries unchanged
            assert states[index] is output.hidden_states[index]
        # id N: not the normed state transformers returns, but what the norm was applied to
        assert not torch.allclose(states[-1], output.hidden_states[-1])
        torch.testing.assert_close(verifier.model.norm(states[-1]), output.hidden_states[-1])
        manual = states[-2]
        positions = torch.arange(ids.shape[1])[None]
        rotary = verifier.model.rotary_emb(manual, positions)
        mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
        manual = layers[-1](manual, attention_mask=mask, position_embeddings=rotary)
        manual = manual[0] if isinstance(manual, tuple) else manual
        torch.testing.assert_close(states[-1], manual)
    assert not verifier.model.layers[-1]._forward_hooks  # closed: the hook is gone
