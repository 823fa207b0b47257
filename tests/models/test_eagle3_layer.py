"""The EAGLE-3 first layer's own forward/backward against transformers' modules composed plainly,
and the shared head gradient of the fused loss."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from speculators_vllm016.models.eagle3.attention import ATTENTION_INTERFACE_NAME
from speculators_vllm016.models.eagle3.fused_loss import WeightGradSink, linear_kl_loss
from speculators_vllm016.models.eagle3.model_definitions import LlamaDecoderEagle3FirstLayer
from speculators_vllm016.models.eagle3.packed_row import StepKeyValues

H = 32


def make_layer(norm_before_residual: bool, attention_bias: bool) -> LlamaDecoderEagle3FirstLayer:
    config = LlamaConfig(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=64,
        max_position_embeddings=64,
        attention_bias=attention_bias,
    )
    config._attn_implementation = ATTENTION_INTERFACE_NAME
    torch.manual_seed(0)
    layer = LlamaDecoderEagle3FirstLayer(config, 0, norm_before_residual=norm_before_residual)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, mean=0.5 if parameter.dim() == 1 else 0.0, std=0.2)
    return layer


def plain_step(layer, embeds, hidden, mask, position_embeddings, cache):
    """The layer written with transformers' own attention and MLP modules, nothing fused."""
    normed_hidden = layer.hidden_norm(hidden)
    residual = normed_hidden if layer.norm_before_residual else hidden
    attention_input = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)
    attended, _ = layer.self_attn(
        attention_input,
        position_embeddings=position_embeddings,
        attention_mask=mask,
        past_key_values=cache,
    )
    mixed = residual + attended
    return mixed + layer.mlp(layer.post_attention_layernorm(mixed))


def two_ttt_steps(layer, step, embeds, hidden):
    """Step 0 causal over 6 positions, step 1 also sees its own step-0 key (the diagonal)."""
    length = hidden.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    masks = [causal, torch.cat([causal, torch.eye(length, dtype=torch.bool)], dim=-1)]
    positions = torch.arange(1, length + 1)[None]
    rotary = LlamaRotaryEmbedding(config=layer.self_attn.config)
    cache = StepKeyValues()
    outputs = []
    for index, mask in enumerate(masks):
        position_embeddings = rotary(hidden, positions + index)
        hidden = step(layer, embeds[index], hidden, mask[None, None], position_embeddings, cache)
        outputs.append(hidden)
    return torch.cat(outputs, dim=1)


def ours_step(layer, embeds, hidden, mask, position_embeddings, cache):
    return layer.ttt_step(
        embeds,
        hidden,
        attention_mask=mask,
        position_embeddings=position_embeddings,
        past_key_values=cache,
    )


@pytest.mark.parametrize(("norm_before_residual", "attention_bias"), [(True, False), (False, True)])
def test_forward_and_every_gradient_equal_the_plain_composition(
    norm_before_residual, attention_bias
):
    layer = make_layer(norm_before_residual, attention_bias)
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(2, 1, 6, H, generator=generator)
    start = torch.randn(1, 6, H, generator=generator)
    upstream = torch.randn(1, 12, H, generator=generator)
    results = []
    for step in (ours_step, plain_step):
        layer.zero_grad(set_to_none=True)
        hidden = start.clone().requires_grad_(True)
        out = two_ttt_steps(layer, step, embeds, hidden)
        (out * upstream).sum().backward()
        grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        results.append((out.detach(), hidden.grad.clone(), grads))
    (ours, ours_input_grad, ours_grads), (plain, plain_input_grad, plain_grads) = results
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(ours_input_grad, plain_input_grad)
    assert ours_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, msg=name)


def test_recomputed_mlp_gives_the_same_gradients():
    layer = make_layer(True, False)
    embeds = torch.randn(2, 1, 6, H)
    start = torch.randn(1, 6, H)
    grads = []
    for recompute in (False, True):
        layer.recompute_mlp = recompute
        layer.zero_grad(set_to_none=True)
        two_ttt_steps(layer, ours_step, embeds, start).square().sum().backward()
        grads.append({name: p.grad.clone() for name, p in layer.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_mlp_and_output_gradients_are_complete_before_the_first_steps_attention_backward():
    """The casts shared by the TTT steps are made at first use, so in the backward pass the
    MLP's and the output projection's weights get their gradients before the first step's
    attention backward reaches the layer's input: DDP can reduce them under that work."""
    layer = make_layer(True, False)
    embeds = torch.randn(2, 1, 6, H, dtype=torch.bfloat16)  # as the fc's output under autocast
    start = torch.randn(1, 6, H, dtype=torch.bfloat16, requires_grad=True)
    arrivals: list[str] = []
    for name, parameter in layer.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda _, name=name: arrivals.append(name))
    start.register_post_accumulate_grad_hook(lambda _: arrivals.append("input"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights = layer.compute_weights(torch.bfloat16)  # one cast per forward, as the draft's

        def shared_step(layer, embeds, hidden, mask, position_embeddings, cache):
            return layer.ttt_step(
                embeds,
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                past_key_values=cache,
                weights=weights,
            )

        out = two_ttt_steps(layer, shared_step, embeds, start)
    out.float().square().sum().backward()
    early = [f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
    early.append("self_attn.o_proj.weight")
    assert set(early) <= set(arrivals)
    assert all(arrivals.index(name) < arrivals.index("input") for name in early), arrivals


def test_shared_head_gradient_equals_separate_gradients_and_survives_a_second_backward():
    """Three calls share a sink, the last one owning the weight (the others get it detached):
    the weight's gradient is that of three separate calls, and the hidden states' too."""
    torch.manual_seed(0)
    weight = torch.randn(11, 5, requires_grad=True)
    hiddens = [torch.randn(7, 5, requires_grad=True) for _ in range(3)]
    targets = [torch.randn(7, 11) for _ in range(3)]
    row_weights = [torch.rand(7) for _ in range(3)]

    def total(sink: WeightGradSink | None) -> torch.Tensor:
        losses = [
            linear_kl_loss(
                h,
                weight if sink is None or index == 2 else weight.detach(),
                t,
                w,
                chunk_size=3,
                weight_grad_sink=sink,
            )[0]
            for index, (h, t, w) in enumerate(zip(hiddens, targets, row_weights, strict=True))
        ]
        return 1.5 * (losses[0] + losses[1] + losses[2])

    total(None).backward()
    expected = weight.grad.clone(), [h.grad.clone() for h in hiddens]
    weight.grad = None
    for h in hiddens:
        h.grad = None
    loss = total(WeightGradSink())
    loss.backward(retain_graph=True)
    torch.testing.assert_close(weight.grad, expected[0])
    for h, grad in zip(hiddens, expected[1], strict=True):
        torch.testing.assert_close(h.grad, grad)
    loss.backward()  # a second round over the retained graph adds the same again
    torch.testing.assert_close(weight.grad, 2 * expected[0])


def test_a_shared_head_gradient_has_one_owner():
    weight = torch.randn(11, 5, requires_grad=True)
    sink = WeightGradSink()
    linear_kl_loss(
        torch.randn(7, 5), weight, torch.randn(7, 11), torch.rand(7), weight_grad_sink=sink
    )
    with pytest.raises(ValueError, match="one linear_kl_loss call"):
        linear_kl_loss(
            torch.randn(7, 5), weight, torch.randn(7, 11), torch.rand(7), weight_grad_sink=sink
        )
