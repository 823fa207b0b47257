"""Decoder-layer building blocks of the EAGLE-3 draft, per transformer family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Cache, LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
)

from speculators_vllm016.models.eagle3.symbolic_dims import (
    compile_symbolic,
    mark_rows,
    marked,
    registered_marks,
)
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = [
    "FirstLayerWeightCache",
    "FirstLayerWeights",
    "LlamaDecoderEagle3FirstLayer",
    "ModelComponents",
    "autocast_dtype",
    "model_classes",
    "maybe_compiled",
    "use_reproducible_compilation",
]

_COMPILED: dict[Callable, Callable] = {}
_REPRODUCIBLE = False
_INDUCTOR_DETERMINISTIC_BEFORE = False


def use_reproducible_compilation(enabled: bool = True) -> None:
    """Compile so that a step's numbers depend on its inputs alone, not on the shapes this
    process compiled for before: what a resumed run needs to continue bit for bit.

    By default a block is compiled for the first shape it meets and again with a symbolic length
    at the second; the two kernels can sum in different orders, so a run resumed at step n (whose
    step n runs the first, fixed-shape kernel) drifts from the uninterrupted run in the last bits
    (2e-5 in the weights after a few steps on an H200). Here every block is compiled with
    symbolic shapes from its first call, and inductor skips the on-device benchmarking that can
    pick kernels of other rounding (`torch._inductor.config.deterministic`). That costs speed.
    A change drops the blocks compiled before it, so call it before the first step;
    `enabled=False` goes back to the default (and to inductor's setting before).
    """
    global _REPRODUCIBLE, _INDUCTOR_DETERMINISTIC_BEFORE
    if enabled == _REPRODUCIBLE:
        return
    import torch._inductor.config as inductor_config

    if enabled:
        _INDUCTOR_DETERMINISTIC_BEFORE = inductor_config.deterministic
    inductor_config.deterministic = True if enabled else _INDUCTOR_DETERMINISTIC_BEFORE
    _REPRODUCIBLE = enabled
    _COMPILED.clear()


def maybe_compiled(function: Callable, enabled: bool) -> Callable:
    """`function` compiled once per process (shared by all callers), or itself.

    Compiled with automatic dynamic shapes: a second row length recompiles once with a symbolic
    length, never once per batch shape (symbolic from the first call after
    `use_reproducible_compilation`).
    """
    if not enabled:
        return function
    if function not in _COMPILED:
        block = torch.compile(function, dynamic=True if _REPRODUCIBLE else None)
        marks = registered_marks(function)
        _COMPILED[function] = block if marks is None else marked(block, marks)
    return _COMPILED[function]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on `device_type`, None when autocast is off there."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x` scaled to unit root mean square per row (an RMS norm without its weight), in its dtype."""
    normalized = x.float()
    return (normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm` as a function of its weight (so the weight can be an input)."""
    return weight * _unit_rms(x, eps)


def _attention_input(
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    embed_norm: torch.Tensor,
    hidden_norm: torch.Tensor,
    embed_eps: float,
    hidden_eps: float,
) -> torch.Tensor:
    """`[input_layernorm(embeds) ; hidden_norm(hidden)]` in the step's dtype."""
    return torch.cat(
        [_rms_norm(embeds, embed_norm, embed_eps), _rms_norm(hidden, hidden_norm, hidden_eps)],
        dim=-1,
    ).to(hidden.dtype)


def _scale_columns_and_weight_grad(
    grad_unit: torch.Tensor, projection: torch.Tensor, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """From `M = grad_out^T @ unit_rms(a)` (`[out, H]`): the projection's gradient columns
    `M * norm_weight` and the norm weight's gradient `sum_j projection[j] * M[j]`."""
    m = grad_unit.float()
    grad_norm_weight = (projection.float() * m).sum(0)
    return (m * norm_weight.float()).to(grad_unit.dtype), grad_norm_weight


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps).to(x.dtype)


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of `[B, L, heads, D]` queries and keys (cos/sin `[B, L, D]`)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    return rotate(q), rotate(k)


def _silu_product(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


def _silu_product_backward(gate_up: torch.Tensor, grad_product: torch.Tensor):
    """`(silu(g) * u, d/d[g ; u])` from the saved `[g ; u]` and the product's gradient."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad = grad_product.float()
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
    dtype = gate_up.dtype
    return (silu * up).to(dtype), torch.cat([grad_gate, grad * silu], dim=-1).to(dtype)


# The blocks a layer runs on its rows, `[B, L, ...]` arguments and per-hidden weights: compiled
# with L symbolic.
for _row_block in (
    _unit_rms,
    _normed,
    _attention_input,
    _rotary,
    _silu_product,
    _silu_product_backward,
):
    compile_symbolic(_row_block, mark_rows)


class _SiluGatedDown(torch.autograd.Function):
    """`down(silu(gate) * up)` from the gate/up projection `[.., 2I]`, keeping only that for the
    backward pass: the `[.., I]` product is rebuilt there (element-wise) instead of stored."""

    @staticmethod
    def forward(ctx, gate_up, weight, bias, compiled):
        product = maybe_compiled(_silu_product, compiled)(gate_up)
        ctx.compiled = compiled
        ctx.has_bias = bias is not None
        ctx.save_for_backward(gate_up, weight)
        return F.linear(product, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        gate_up, weight = ctx.saved_tensors
        grad_product = grad_out @ weight
        product, grad_gate_up = maybe_compiled(_silu_product_backward, ctx.compiled)(
            gate_up, grad_product
        )
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.T @ product.reshape(-1, product.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_gate_up, grad_weight, grad_bias, None


def _spread(rows: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    """`[B, n, ...]` rows placed at `positions` of a `[B, length, ...]` tensor of zeros."""
    shape = (rows.shape[0], length, *rows.shape[2:])
    return rows.new_zeros(shape).index_copy(1, positions, rows)


class _LinearOfRows(torch.autograd.Function):
    """`F.linear(x[:, rows], weight, bias)` that keeps `x` for the backward pass, not the
    gathered copy: `x` (the attention output) is kept by the attention's backward anyway."""

    @staticmethod
    def forward(ctx, x, rows, weight, bias):
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, rows, weight)
        return F.linear(x[:, rows], weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, rows, weight = ctx.saved_tensors
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _spread(grad_out @ weight, rows, x.shape[1])
        if ctx.needs_input_grad[2]:
            grad_weight = flat_grad.T @ x[:, rows].reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = flat_grad.sum(0)
        return grad_x, None, grad_weight, grad_bias


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """What a backward pass needs to rebuild forward work under the forward's autocast."""
    return (
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
    )


def _rebuilding(state: tuple[str, bool, torch.dtype]):
    """Grad mode and the forward's autocast, for recomputing forward work in a backward pass."""
    device_type, enabled, dtype = state
    return torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _leaf(saved: torch.Tensor, need: bool, parameter: bool) -> torch.Tensor:
    """A saved tensor as a leaf of a backward pass's recomputation, of the kind the forward got:
    a norm weight as a parameter (same storage), so the compiled `_normed` graph of the residual
    norm serves the recomputation too (dynamo tells a plain tensor apart: one more graph)."""
    leaf = saved.detach()
    return nn.Parameter(leaf, requires_grad=need) if parameter else leaf.requires_grad_(need)


class _ProjectRebuiltInput(torch.autograd.Function):
    """`F.linear(build(*sources), weight, bias)` that keeps `sources` for the backward pass, not
    the projection's input: `build` is cheap element-wise work (norms, concatenation) whose
    output is larger than its sources, so it is run again there."""

    @staticmethod
    def forward(ctx, build, weight, bias, *sources):
        ctx.autocast = _autocast_state(weight.device.type)
        ctx.build = build
        ctx.has_bias = bias is not None
        x = build(*sources)
        # Tensors are saved through autograd; the rest (norm epsilons) as they are.
        ctx.is_tensor = [isinstance(source, torch.Tensor) for source in sources]
        ctx.is_parameter = [isinstance(source, nn.Parameter) for source in sources]
        ctx.constants = [
            None if tensor else source
            for source, tensor in zip(sources, ctx.is_tensor, strict=True)
        ]
        ctx.save_for_backward(weight, *(s for s in sources if isinstance(s, torch.Tensor)))
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        saved = iter(tensors)
        leaves = [
            _leaf(next(saved), need, parameter) if tensor else constant
            for tensor, constant, need, parameter in zip(
                ctx.is_tensor, ctx.constants, needs, ctx.is_parameter, strict=True
            )
        ]
        grad_mode, autocast = _rebuilding(ctx.autocast)
        with grad_mode, autocast:
            x = ctx.build(*leaves)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.T @ x.detach().reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        wanted = [leaf for leaf, need in zip(leaves, needs, strict=True) if need]
        found = iter(torch.autograd.grad(x, wanted, grad_out @ weight) if wanted else ())
        grads = [next(found) if need else None for need in needs]
        return None, grad_weight, grad_bias, *grads


class _ProjectNormedPair(torch.autograd.Function):
    """`F.linear([a_weight * unit_rms(a) ; b_weight * unit_rms(b)], weight, bias)` for an `a` that
    needs no gradient (the token embeddings).

    `_ProjectRebuiltInput` would form the input's whole gradient `grad_out @ weight` only to
    reduce its `a` half to the `[H]` gradient of `a_weight`. Here that half comes from the weight
    gradient's matmul instead, run on `unit_rms(a)` in place of `a_weight * unit_rms(a)`: its
    `a` columns `M = grad_out^T @ unit_rms(a)` give the weight's gradient as `M * a_weight` and
    `a_weight`'s as `sum_j weight[j, :H] * M[j]`, and the input gradient's matmul shrinks to the
    `b` half (a quarter of the layer's q/k/v backward work at EAGLE-3 shapes).
    """

    @staticmethod
    def forward(ctx, weight, bias, a, b, a_weight, b_weight, a_eps, b_eps, compiled):
        ctx.autocast = _autocast_state(weight.device.type)
        ctx.has_bias = bias is not None
        ctx.eps = (a_eps, b_eps)
        ctx.compiled, ctx.b_weight_is_parameter = compiled, isinstance(b_weight, nn.Parameter)
        x = maybe_compiled(_attention_input, compiled)(a, b, a_weight, b_weight, a_eps, b_eps)
        ctx.save_for_backward(weight, a, b, a_weight, b_weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight, a, b, a_weight, b_weight = ctx.saved_tensors
        need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b, need_a_weight, need_b_weight = (ctx.needs_input_grad[i] for i in (3, 4, 5))
        a_eps, b_eps = ctx.eps
        size = a.shape[-1]
        b_leaf = b.detach().requires_grad_(need_b)
        b_weight_leaf = _leaf(b_weight, need_b_weight, ctx.b_weight_is_parameter)
        grad_mode, autocast = _rebuilding(ctx.autocast)
        with grad_mode, autocast:
            x_b = maybe_compiled(_normed, ctx.compiled)(b_leaf, b_weight_leaf, b_eps).to(b.dtype)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_a_weight = None
        if need_weight or need_a_weight:
            unit_a = maybe_compiled(_unit_rms, ctx.compiled)(a.to(b.dtype), a_eps)
            inputs = torch.cat([unit_a, x_b.detach()], dim=-1).reshape(-1, 2 * size)
            products = flat_grad.T @ inputs  # [out, 2H]; its `a` columns are M
            scaled, grad_a_weight = maybe_compiled(_scale_columns_and_weight_grad, ctx.compiled)(
                products[:, :size], weight[:, :size], a_weight
            )
            products[:, :size] = scaled
            grad_weight = products if need_weight else None
            grad_a_weight = grad_a_weight.to(a_weight.dtype) if need_a_weight else None
        grad_bias = flat_grad.sum(0) if ctx.has_bias and need_bias else None
        grad_b = grad_b_weight = None
        wanted = [leaf for leaf, need in ((b_leaf, need_b), (b_weight_leaf, need_b_weight)) if need]
        if wanted:
            found = iter(torch.autograd.grad(x_b, wanted, grad_out @ weight[:, size:]))
            grad_b = next(found) if need_b else None
            grad_b_weight = next(found) if need_b_weight else None
        return grad_weight, grad_bias, None, grad_b, grad_a_weight, grad_b_weight, None, None, None


class FirstLayerWeights:
    """The first layer's projections in the compute dtype, fused where they share an input.

    One per layer and forward pass, shared by every TTT step: one cast per weight instead of
    one per step, and the gradients of all steps meet in the one cast on their way to the
    (fp32) parameters. Each projection is cast at its first use, not all at the layer's first
    call: autograd runs the ready node made last first, so in the backward pass a cast made
    just before the first step's MLP hands the MLP's gradients to the parameters as soon as
    that step's MLP backward is done. Under DDP they are then reduced while the first step's
    attention backward runs, instead of all gradients waiting for the end of the pass.
    """

    def __init__(self, layer: LlamaDecoderEagle3FirstLayer, dtype: torch.dtype | None) -> None:
        self._layer = layer
        self._dtype = dtype
        self._made: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _cast(self, name: str, *linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        if name not in self._made:
            self._made[name] = _fused(list(linears), self._dtype)
        return self._made[name]

    def qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k and v stacked (weight, bias)."""
        attention = self._layer.self_attn
        return self._cast("qkv", attention.q_proj, attention.k_proj, attention.v_proj)

    def o(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._cast("o", self._layer.self_attn.o_proj)

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """gate and up stacked (weight, bias)."""
        mlp = self._layer.mlp
        return self._cast("gate_up", mlp.gate_proj, mlp.up_proj)

    def down(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._cast("down", self._layer.mlp.down_proj)


class FirstLayerWeightCache:
    """The cast weights of each first layer for one forward pass (see `FirstLayerWeights`).

    The draft passes one per forward pass to every TTT step's layer call. The casts happen
    inside the layer's own calls (where FSDP2 has gathered its parameters), and only once.
    """

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._weights: dict[int, FirstLayerWeights] = {}

    def weights_of(self, layer: LlamaDecoderEagle3FirstLayer) -> FirstLayerWeights:
        if id(layer) not in self._weights:
            self._weights[id(layer)] = layer.compute_weights(self.dtype)
        return self._weights[id(layer)]


def _fused(linears: list[nn.Linear], dtype: torch.dtype | None):
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    weights = [cast(linear.weight) for linear in linears]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    if linears[0].bias is None:
        return weight, None
    biases = [cast(linear.bias) for linear in linears]
    return weight, biases[0] if len(biases) == 1 else torch.cat(biases)


class LlamaDecoderEagle3FirstLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention reads `[token embedding ; fused hidden state]`.

    The two halves are normalized separately (`input_layernorm` for the embedding, `hidden_norm`
    for the hidden state); q/k/v project from twice the hidden size. The residual is the hidden
    half, normalized first when `norm_before_residual`.

    `ttt_step` is the computation (what `forward` runs on the concatenated input). It keeps for
    the backward pass only what is expensive to rebuild: the projections' inputs that are mere
    norms of smaller tensors, and the MLP's `silu(gate) * up`, are recomputed there.
    `compile_blocks` (set by the draft model on accelerators) compiles the element-wise pieces;
    `recompute_mlp` keeps only the MLP's input and recomputes the rest in the backward pass.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int, norm_before_residual: bool = False):
        super().__init__(config, layer_idx)
        self.norm_before_residual = norm_before_residual
        self.compile_blocks = False
        self.recompute_mlp = False
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        wide = 2 * config.hidden_size
        bias = getattr(config, "attention_bias", False)
        attention = self.self_attn
        attention.q_proj = nn.Linear(wide, config.num_attention_heads * head_dim, bias=bias)
        attention.k_proj = nn.Linear(wide, config.num_key_value_heads * head_dim, bias=bias)
        attention.v_proj = nn.Linear(wide, config.num_key_value_heads * head_dim, bias=bias)

    def compute_weights(self, dtype: torch.dtype | None) -> FirstLayerWeights:
        """The projections cast to `dtype` (None: as stored) at first use, q/k/v and gate/up
        concatenated."""
        return FirstLayerWeights(self, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        cache_position: torch.LongTensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_embeds: torch.Tensor | None = None,
        weight_cache: FirstLayerWeightCache | None = None,
        positions: torch.Tensor | None = None,
        keys_everywhere: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """0.3.0's call on `[embeds ; hidden]`, or with `input_embeds` on the hidden state alone
        (no concatenated copy); `weight_cache` shares the weight casts between calls;
        `positions` / `keys_everywhere` as in `ttt_step`."""
        if input_embeds is None:
            embeds, hidden = hidden_states.chunk(2, dim=-1)
        else:
            embeds, hidden = input_embeds, hidden_states
        return self.ttt_step(
            embeds,
            hidden,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=past_key_values,
            weights=weight_cache.weights_of(self) if weight_cache is not None else None,
            positions=positions,
            keys_everywhere=keys_everywhere,
            **kwargs,
        )

    def ttt_step(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        *,
        attention_mask: Any,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        past_key_values: Any = None,
        weights: FirstLayerWeights | None = None,
        positions: torch.Tensor | None = None,
        keys_everywhere: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One step over `[B, L, H]` token embeddings and hidden states; returns `[B, L, H]`.

        `positions` (sorted `[n]` sequence indices, None: all) are the positions whose output the
        caller reads: the layer runs its projections and MLP over those rows alone, and the
        other rows of the output are zeros. Their keys and values are taken as read only by
        their own position's queries (true of TTT steps after the first, whose keys only the
        same position sees); `keys_everywhere` (the first step, whose keys every later position
        of the sample reads) still projects every row's keys and values and skips only the
        queries' side: attention output, output projection and MLP.
        """
        if position_embeddings is None:
            raise InvalidInputError("the EAGLE-3 layer needs position_embeddings (cos, sin)")
        if weights is None:
            weights = self.compute_weights(autocast_dtype(hidden.device.type))
        compiled = self.compile_blocks
        dtype = hidden.dtype
        embeds = embeds.to(dtype)
        attention = self.self_attn
        batch, full_length = hidden.shape[:2]
        head_dim = attention.head_dim
        cos, sin = position_embeddings
        projected = positions is not None and not keys_everywhere
        if projected:  # only these rows get queries, keys and values
            embeds, hidden = embeds[:, positions], hidden[:, positions]
            cos, sin = cos[:, positions], sin[:, positions]
        length = hidden.shape[1]

        norms = (
            self.input_layernorm.weight,
            self.hidden_norm.weight,
            self.input_layernorm.variance_epsilon,
            self.hidden_norm.variance_epsilon,
        )
        qkv_weight, qkv_bias = weights.qkv()
        if embeds.requires_grad:
            build = maybe_compiled(_attention_input, compiled)
            qkv = _ProjectRebuiltInput.apply(build, qkv_weight, qkv_bias, embeds, hidden, *norms)
        else:  # training: the embeddings are frozen
            qkv = _ProjectNormedPair.apply(qkv_weight, qkv_bias, embeds, hidden, *norms, compiled)
        heads = attention.config.num_attention_heads
        kv_heads = attention.config.num_key_value_heads
        query, key, value = qkv.split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        query, key = maybe_compiled(_rotary, compiled)(
            query.view(batch, length, heads, head_dim),
            key.view(batch, length, kv_heads, head_dim),
            cos,
            sin,
        )
        value = value.view(batch, length, kv_heads, head_dim)
        if projected:  # back in place along the row; the rows in between are never read
            query, key, value = (_spread(x, positions, full_length) for x in (query, key, value))
        # [B, heads, L, D] views of [B, L, heads, D] tensors: flex attention writes its output
        # in the query's layout, so the output projection reads it without a copy.
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, attention.layer_idx)
        implementation = attention.config._attn_implementation
        interface = (
            eager_attention_forward
            if implementation in (None, "eager")
            else ALL_ATTENTION_FUNCTIONS[implementation]
        )
        attended, _ = interface(
            attention,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else attention.attention_dropout,
            scaling=attention.scaling,
            **kwargs,
        )
        attended = attended.reshape(batch, full_length, -1)
        if positions is None:
            attended = F.linear(attended, *weights.o())
        else:
            attended = _LinearOfRows.apply(attended, positions, *weights.o())
            if not projected:
                hidden = hidden[:, positions]

        if self.norm_before_residual:
            residual = maybe_compiled(_normed, compiled)(
                hidden, self.hidden_norm.weight, self.hidden_norm.variance_epsilon
            )
        else:
            residual = hidden
        mlp_input = residual + attended
        # Cast outside a recomputed region: the casts are shared with the later TTT steps.
        mlp_weights = (*weights.gate_up(), *weights.down())
        if self.recompute_mlp and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            mlp_output = checkpoint(self._mlp, mlp_input, *mlp_weights, use_reentrant=False)
        else:
            mlp_output = self._mlp(mlp_input, *mlp_weights)
        output = (mlp_input + mlp_output).to(dtype)
        if positions is not None:
            output = _spread(output, positions, full_length)
        return output

    def _mlp(
        self,
        x: torch.Tensor,
        gate_up_weight: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_weight: torch.Tensor,
        down_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        norm = self.post_attention_layernorm
        gate_up = _ProjectRebuiltInput.apply(
            maybe_compiled(_normed, self.compile_blocks),
            gate_up_weight,
            gate_up_bias,
            x,
            norm.weight,
            norm.variance_epsilon,
        )
        if self.mlp.config.hidden_act in ("silu", "swish"):
            return _SiluGatedDown.apply(gate_up, down_weight, down_bias, self.compile_blocks)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(self.mlp.act_fn(gate) * up, down_weight, down_bias)


class ModelComponents(NamedTuple):
    first_layer_class: type
    decoder_layer_class: type
    norm_class: type
    rotary_emb_class: type


model_classes: dict[str, ModelComponents] = {
    "llama": ModelComponents(
        LlamaDecoderEagle3FirstLayer, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
    ),
}
