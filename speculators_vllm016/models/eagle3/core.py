"""The EAGLE-3 draft model and its training objective.

The draft fuses three auxiliary hidden states of the target (`fc`), runs one decoder layer on
`[token embedding ; fused state]`, and predicts over a reduced draft vocabulary (`d2t` maps draft
ids back to target ids, `t2d` marks the kept target ids). Training unrolls `ttt_steps` test-time
steps: each step feeds the draft's own previous prediction and hidden state back in, and is scored
against the target's distribution `ttt_step` tokens further ahead.

Alignment (after the trainer's `shift_batch`): position i holds the token x[i+1], the target's
fused states of token i, and `verifier_last_hidden_states` of token i+1, so `target_logits[i]`
is the target's distribution of x[i+2]. Step k at position i predicts x[i+k+2] and is scored
against `target_logits[i+k]` (`align_for_step`); a pair whose two positions lie in different
packed samples is not scored.

The model lives here; its parts each have a module: the typed output (`output`), the scoring of
the TTT steps and the choice of positions (`scoring`), the fused loss kernel (`fused_loss`),
0.3.0's eager loss and metrics (`metrics`), and the verifier weights it copies
(`verifier_weights`). 0.3.0's loss and metric functions still import from here
(`align_for_step`, `compute_accuracy`, `compute_metrics`, `loss_function`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.models.eagle3 import mla_layer as _mla_layer  # noqa: F401 (registers it)
from speculators_vllm016.models.eagle3.attention import (
    ATTENTION_INTERFACE_NAME,
    extend_mask_for_draft_tokens,
    key_capacity,
    step_mask,
)
from speculators_vllm016.models.eagle3.config import Eagle3SpeculatorConfig, sliding_window_of
from speculators_vllm016.models.eagle3.fused_loss import WeightGradSink
from speculators_vllm016.models.eagle3.fusion import fuse_aux_states, fusion_norms
from speculators_vllm016.models.eagle3.metrics import (
    compute_accuracy,
    compute_metrics,
    loss_function,
)
from speculators_vllm016.models.eagle3.mla_layout import MLA_KEY_MAPPING, is_mla_layer_config
from speculators_vllm016.models.eagle3.model_definitions import (
    FirstLayerWeightCache,
    autocast_dtype,
    maybe_compiled,
    model_classes,
)
from speculators_vllm016.models.eagle3.output import Eagle3DraftOutput
from speculators_vllm016.models.eagle3.packed_row import PackedRow, StepKeyValues, pack_row
from speculators_vllm016.models.eagle3.proposer import Eagle3Proposer
from speculators_vllm016.models.eagle3.scoring import (
    ScoringPass,
    align_for_step,
)
from speculators_vllm016.utils.errors import InvalidInputError
from speculators_vllm016.utils.layer_ids import eagle3_aux_layer_ids
from speculators_vllm016.utils.verifier_weights import VerifierInfo

__all__ = [
    "AttentionBackend",
    "DraftLMHead",
    "Eagle3DraftModel",
    "align_for_step",
    "compute_accuracy",
    "compute_metrics",
    "loss_function",
]

AttentionBackend = Literal["auto", "flex", "sdpa"]


class DraftLMHead(nn.Linear):
    """The draft's LM head: a bias-free `nn.Linear` (the same `lm_head.weight` in checkpoints).

    The fused loss reads `weight` directly instead of calling the module, for all TTT steps at
    once. `mark_read` is a call of the module that returns its argument unchanged; the draft
    makes one before its first direct read of a forward pass (no argument) and one on the last
    TTT step's head input. A wrapper that acts on module calls (FSDP2, through
    `register_fsdp_forward_method`) then has the weight gathered before it is read, and
    reduces its gradient as soon as that input's gradient exists. The last step's loss is the
    weight's one differentiable use (see `WeightGradSink`) and the first to run backward, so the
    gradient is complete by then and its reduction overlaps the rest of the backward pass.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def mark_read(self, tensor: torch.Tensor | None = None) -> torch.Tensor | None:
        return tensor


def _final_norm(model: Eagle3DraftModel, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel of `Eagle3DraftModel.final_norm` (compiled once per process when asked)."""
    return model.norm(hidden).to(dtype)


@SpeculatorModel.register("eagle3")
class Eagle3DraftModel(SpeculatorModel):
    """EAGLE-3 draft for training and for export to vLLM.

    `Eagle3DraftModel(config, t2d, d2t)` builds a draft for training: the token embeddings, the
    verifier's final norm and the LM head rows of the draft vocabulary are copied from the
    verifier named in the config (embeddings, norm and a copy of the head stay frozen; the frozen
    norm and head turn the verifier's last hidden states into the training targets).
    `Eagle3DraftModel(config)` (as `from_pretrained` does) builds the empty shell whose weights
    come from a checkpoint. `use_verifier_norm=False` scores against the head without the norm,
    as 0.3.0 did (its defect D1).

    Speed knobs (plain attributes, read at every forward): `attention_backend` "flex"
    (block-sparse flex attention, compiled on accelerators), "sdpa" (dense masks) or "auto"
    (flex on CUDA, SDPA elsewhere; a layer config whose `_attn_implementation` is
    "simple_flex_attention" starts at "flex"); `compile_blocks` (None: on CUDA) compiles the
    element-wise work of the first layer and of the loss; `loss_chunk_size` rows of logits exist
    at a time; `skip_unscored_rows` (None: off on CPUs) runs the loss's gradient matmuls over the
    scored positions only (see `linear_kl_loss`). On a CPU it changed the last bits of training
    with the thread count (a resumed run under another OMP_NUM_THREADS was no longer
    bit-identical to the uninterrupted one), and CPU runs are small, so it stays off there.
    `skip_unused_positions` (False; None: on CUDA only; the trainer's choice is None) runs each
    TTT step's layer only over the positions whose output a loss term or metric reads
    (`used_positions`: the last step's scored ones, the earlier steps' scored or loss-masked
    ones) where that leaves out at least a tenth of the real positions (padding aside;
    `MAX_USED_FRACTION_TO_SKIP`), for single-layer drafts scored without `output_logits`; the
    loss's row skip comes with it.
    Loss, metrics and gradients are unchanged, but the draft tokens of the other positions are
    not computed (-1), which 0.3.0 never returned: hence off by default.
    `flex_row_length` (None) pads every flex row to at least that many positions (the trainer
    sets its `--total-seq-len`): every row of a run then has one shape, so the compiled blocks
    compile once (the layer's row-wise ones symbolic in the row length: the subsets of
    `skip_unused_positions` vary) and a shorter row (the last of an epoch) recompiles nothing.
    The padding sees only itself and is never scored.
    Mixed precision: keep the parameters fp32 and run the forward under
    `torch.autocast(device, torch.bfloat16)`; `frozen_weights_to(torch.bfloat16)` halves the
    memory of the frozen verifier copies.
    """

    config_class: ClassVar[type[Eagle3SpeculatorConfig]] = Eagle3SpeculatorConfig  # type: ignore[misc]
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = [  # type: ignore[misc]
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [  # type: ignore[misc]
        "verifier_norm.weight",
    ]
    _keys_to_ignore_on_save: ClassVar[list[str]] = [  # type: ignore[misc]
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]

    def __init__(
        self,
        config: Eagle3SpeculatorConfig,
        t2d: torch.Tensor | None = None,
        d2t: torch.Tensor | None = None,
        *,
        use_verifier_norm: bool = True,
        verifier: VerifierInfo | None = None,
    ) -> None:
        super().__init__(config=config, verifier=None, verifier_attachment_mode="train_only")
        requested = getattr(config.transformer_layer_config, "_attn_implementation", None)
        # The layers get their own copy whose attention is ours (flex or SDPA by mask type);
        # the caller's config is left as it was.
        layer_config = copy.copy(config.transformer_layer_config)
        layer_config._attn_implementation = ATTENTION_INTERFACE_NAME
        self.attention_backend: AttentionBackend = (
            "flex" if requested in (ATTENTION_INTERFACE_NAME, "flex_attention") else "auto"
        )
        self.compile_blocks: bool | None = None
        self.skip_unscored_rows: bool | None = None
        self.skip_unused_positions: bool | None = False
        self.loss_chunk_size = 4096
        self.flex_row_length: int | None = None
        if layer_config.model_type not in model_classes:
            raise InvalidInputError(
                f"no EAGLE-3 layer for transformer type {layer_config.model_type!r}; "
                f"supported: {sorted(model_classes)}"
            )
        components = model_classes[layer_config.model_type]
        self.hidden_size = layer_config.hidden_size
        self.target_hidden_size = config.target_hidden_size or self.hidden_size
        self.draft_vocab_size = config.draft_vocab_size
        self.use_verifier_norm = use_verifier_norm
        target_vocab = layer_config.vocab_size
        from_verifier = t2d is not None or d2t is not None
        if from_verifier and (t2d is None or d2t is None):
            raise InvalidInputError("pass both t2d and d2t (or neither, to load from a checkpoint)")
        if t2d is None:
            t2d = torch.zeros(target_vocab, dtype=torch.bool)
            d2t = torch.zeros(self.draft_vocab_size, dtype=torch.long)
        self._check_vocab_maps(t2d, d2t, target_vocab, strict=from_verifier)
        self.register_buffer("t2d", t2d.to(torch.bool))
        self.register_buffer("d2t", d2t.to(torch.long))

        self.fc = nn.Linear(3 * self.target_hidden_size, self.hidden_size, bias=False)
        self.input_norm, self.fc_norm = fusion_norms(
            components.norm_class,
            self.target_hidden_size,
            3,
            layer_config.rms_norm_eps,
            norm_before_fc=config.norm_before_fc,
            fc_norm=config.fc_norm,
        )
        first = components.first_layer_class(
            layer_config, layer_idx=0, norm_before_residual=config.norm_before_residual
        )
        rest = [
            components.decoder_layer_class(layer_config, index)
            for index in range(1, layer_config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList([first, *rest])
        self.norm = components.norm_class(self.hidden_size, eps=layer_config.rms_norm_eps)
        self.rotary_emb = components.rotary_emb_class(config=layer_config)
        self.embed_tokens = nn.Embedding(target_vocab, self.hidden_size)
        self.lm_head = DraftLMHead(self.hidden_size, self.draft_vocab_size)
        self.verifier_norm: nn.Module | None = (
            components.norm_class(self.target_hidden_size, eps=layer_config.rms_norm_eps)
            if use_verifier_norm
            else None
        )
        self.verifier_lm_head = nn.Linear(
            self.target_hidden_size, self.draft_vocab_size, bias=False
        )
        self.post_init()
        self.embed_tokens.weight.requires_grad_(False)
        self.verifier_lm_head.weight.requires_grad_(False)
        if self.verifier_norm is not None:
            self.verifier_norm.weight.requires_grad_(False)
        if from_verifier:
            self.load_verifier_weights(verifier)

    @classmethod
    def checkpoint_key_mapping(cls, config: Eagle3SpeculatorConfig) -> dict[str, str] | None:
        """MLA drafts: TorchSpec's `midlayer.` read as `layers.0.` (as vLLM does)."""
        if is_mla_layer_config(config.transformer_layer_config):
            return dict(MLA_KEY_MAPPING)
        return None

    def complete_missing_weights(self, missing: list[str]) -> list[str]:
        """A full-vocabulary draft may leave out `t2d` / `d2t` (TorchSpec writes them only for a
        reduced vocabulary): they are then the identity maps."""
        maps = {"t2d", "d2t"}
        if not maps & set(missing) or self.draft_vocab_size != self.t2d.shape[0]:
            return missing
        device = self.lm_head.weight.device
        self.t2d = torch.ones(self.draft_vocab_size, dtype=torch.bool, device=device)
        self.d2t = torch.zeros(self.draft_vocab_size, dtype=torch.long, device=device)
        return [name for name in missing if name not in maps]

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Never tie: the draft head covers the draft vocabulary, the embeddings the target's."""

    def _check_vocab_maps(
        self, t2d: torch.Tensor, d2t: torch.Tensor, target_vocab: int, strict: bool
    ) -> None:
        if t2d.shape != (target_vocab,):
            raise InvalidInputError(f"t2d has shape {tuple(t2d.shape)}, expected ({target_vocab},)")
        if d2t.shape != (self.draft_vocab_size,):
            raise InvalidInputError(
                f"d2t has shape {tuple(d2t.shape)}, expected ({self.draft_vocab_size},)"
            )
        if strict and int(t2d.sum()) != self.draft_vocab_size:
            raise InvalidInputError(
                f"t2d marks {int(t2d.sum())} tokens, expected draft_vocab_size="
                f"{self.draft_vocab_size}"
            )

    def load_verifier_weights(self, verifier_path: str | VerifierInfo | None = None) -> None:
        """Copy embeddings, the final norm (with its eps) and the draft-vocabulary rows of the
        LM head from the verifier (a `VerifierInfo` a job already read: not read again); all
        three stay frozen."""
        verifier = (
            self.config.speculators_config.verifier if self.config.speculators_config else None
        )
        path = verifier_path or (verifier.name_or_path if verifier else None)
        if not path:
            raise InvalidInputError(
                "the config names no verifier (speculators_config.verifier.name_or_path)"
            )
        info = path if isinstance(path, VerifierInfo) else VerifierInfo.read(path)
        found = info.weights()
        embeddings, head = found.embeddings, found.head
        if embeddings.shape != self.embed_tokens.weight.shape:
            raise InvalidInputError(
                f"verifier embeddings {tuple(embeddings.shape)} do not fit the draft's "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab size and hidden size must match)"
            )
        rows = head[self.t2d.to(head.device)]
        dtype = self.lm_head.weight.dtype
        self._materialize_frozen()
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embeddings.to(dtype))
            self.lm_head.weight.copy_(rows.to(dtype))
            self.verifier_lm_head.weight.copy_(rows.to(dtype))
        if self.verifier_norm is None:
            return
        norm = found.norm
        if norm is None:
            raise InvalidInputError(
                f"{info.path} has no final norm {found.norm_name!r}; pass use_verifier_norm=False to "
                "score against the LM head alone (0.3.0's behaviour)"
            )
        if norm.shape != self.verifier_norm.weight.shape:
            raise InvalidInputError(
                f"verifier norm {tuple(norm.shape)} does not fit target_hidden_size "
                f"{self.target_hidden_size}"
            )
        eps = info.rms_norm_eps
        if eps is not None:
            self.verifier_norm.variance_epsilon = eps
        with torch.no_grad():
            self.verifier_norm.weight.copy_(norm.to(self.verifier_norm.weight.dtype))

    def _materialize_frozen(self) -> None:
        """Give the frozen verifier copies real storage: `from_pretrained` leaves the ones a
        checkpoint does not hold (never saved) on the meta device."""
        device = self.lm_head.weight.device
        dtype = self.lm_head.weight.dtype
        for module in (self.verifier_lm_head, self.verifier_norm, self.embed_tokens):
            if module is not None and module.weight.is_meta:
                fresh = torch.ones(module.weight.shape, device=device, dtype=dtype)
                module.weight = nn.Parameter(fresh, requires_grad=False)

    @torch.no_grad()
    def target_logits(self, verifier_last_hidden_states: torch.Tensor) -> torch.Tensor:
        """The training targets over the draft vocabulary: the verifier's own logits.

        `verifier_last_hidden_states` is the verifier's last decoder layer output before its
        final norm (what datagen stores); the frozen norm and LM head rows turn it into logits.
        """
        if self.verifier_lm_head.weight.is_meta:
            raise InvalidInputError(
                "the verifier's LM head is not loaded (checkpoints do not hold it); call "
                "load_verifier_weights() before training or scoring"
            )
        hidden = verifier_last_hidden_states
        if self.verifier_norm is not None:
            hidden = self.verifier_norm(hidden)
        return self.verifier_lm_head(hidden.to(self.verifier_lm_head.weight.dtype))

    def frozen_weights_to(self, dtype: torch.dtype) -> None:
        """Store the frozen verifier copies (embeddings, final norm, LM head) in `dtype`.

        They are never trained, so bf16 storage loses nothing that bf16 compute would keep.
        """
        for module in (self.embed_tokens, self.verifier_norm, self.verifier_lm_head):
            if module is not None:
                module.to(dtype)

    def resolved_attention_backend(self, device: torch.device) -> Literal["flex", "sdpa"]:
        """The attention path a forward on `device` takes."""
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise InvalidInputError(
                f"attention_backend must be 'auto', 'flex' or 'sdpa', got {self.attention_backend!r}"
            )
        if self.attention_backend == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return self.attention_backend

    def _compiling(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile_blocks is None else bool(self.compile_blocks)

    def prepare_blocks(self, device: torch.device) -> bool:
        """Tell the layers whether a pass on `device` runs their compiled blocks; returns it."""
        compiled = self._compiling(device)
        for layer in self.layers:
            layer.compile_blocks = compiled
        return compiled

    @property
    def attention_window(self) -> int | None:
        """The sliding window of the draft's attention (`layer_types` / `sliding_window` of its
        layer config, as vLLM reads them), None for full attention."""
        return sliding_window_of(self.config.transformer_layer_config)

    def _skipping_unscored_rows(self, device: torch.device) -> bool:
        if self.skip_unscored_rows is None:
            return device.type != "cpu"
        return bool(self.skip_unscored_rows)

    def _skipping_unused_positions(self, device: torch.device) -> bool:
        if self.skip_unused_positions is None:  # measured and tested on CUDA only
            return device.type == "cuda"
        return bool(self.skip_unused_positions)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        lengths: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        verifier_last_hidden_states: torch.Tensor | None = None,
        ttt_steps: int = 3,
        ttt_step_loss_decay: float = 1.0,
        use_off_policy_tokens: bool = False,
        output_logits: bool = False,
        **kwargs: Any,
    ) -> Eagle3DraftOutput:
        """Unroll `ttt_steps` draft steps over a packed row `[1, total_seq_len]`.

        `hidden_states` `[1, T, 3 * target_hidden]` are the fused auxiliary target states,
        `input_ids` `[1, T]` the tokens paired with them (the shifted batch: position i holds token
        x[i+1] beside the states of token i). Step 0 feeds `input_ids`; step k > 0 feeds the draft's
        own previous argmax (mapped through `d2t`), or with `use_off_policy_tokens=True` the ground
        truth: `input_ids[i + k]` at position i, the token x[i+k+1] the chain from i would have
        produced at step k - 1 had every earlier step been right (teacher forcing; zeros past the
        row's end, unscored). `output_logits=True` also returns every step's draft logits
        `[1, T, draft_vocab]`; with `skip_unused_positions`, positions nothing reads draft -1."""
        row = pack_row(
            hidden_states,
            input_ids,
            lengths,
            position_ids,
            flex=self.resolved_attention_backend(hidden_states.device) == "flex",
            pad_to=self.flex_row_length,
            window=self.attention_window,
        )
        compiled = self.prepare_blocks(row.device)
        hidden = self.fuse_aux_states(row.hidden_states)
        cast_dtype = autocast_dtype(row.device.type)
        compute_dtype = cast_dtype or hidden.dtype
        # Each weight is cast once per forward pass, at its first use; the TTT steps share it.
        layer_weights = FirstLayerWeightCache(cast_dtype)
        scoring = None
        if verifier_last_hidden_states is not None:
            scoring = self._start_scoring(
                row,
                verifier_last_hidden_states,
                loss_mask,
                ttt_steps,
                ttt_step_loss_decay,
                compute_dtype,
                compiled,
                output_logits,
            )
        kwargs.update(key_capacity(row.mask, ttt_steps))  # one flex kernel for every step
        cache = StepKeyValues(kwargs.get("kv_capacity"))  # keys padded to it: one copy a step
        input_ids, position_ids, mask = row.input_ids, row.position_ids, row.mask
        draft_tokens: list[torch.Tensor] = []
        all_logits: list[torch.Tensor] | None = [] if output_logits else None
        for step in range(ttt_steps):
            with torch.no_grad():
                embeds = self.embed_tokens(input_ids)
            hidden = self.run_layers(
                embeds,
                hidden,
                position_ids,
                mask,
                cache,
                layer_weights,
                positions=scoring.positions[step] if scoring is not None else None,
                keys_everywhere=step == 0,
                **kwargs,
            )
            normed = self.final_norm(hidden, compute_dtype, compiled)[0]
            if self.config.norm_output:  # EAGLE-3.1: the next step reads the normed state
                hidden = normed[None]
            if all_logits is not None:
                all_logits.append(self.lm_head(normed[: row.total])[None])
            if scoring is not None:
                predicted = self._score_step(scoring, step, normed)[None]
            else:
                predicted = self.draft_argmax(normed)[None]
            draft_tokens.append(predicted[:, : row.total].detach().clone())
            input_ids = self._next_input_ids(row, predicted, step, use_off_policy_tokens)
            if self.attention_window is None:
                mask = extend_mask_for_draft_tokens(mask)
            elif step + 1 < ttt_steps:
                flex = not isinstance(row.mask, torch.Tensor)
                mask = step_mask(row.documents, step + 1, flex=flex, window=self.attention_window)
            position_ids = position_ids + 1
        if scoring is None:
            return Eagle3DraftOutput(draft_tokens, None, None, all_logits)
        return Eagle3DraftOutput(draft_tokens, scoring.loss, scoring.final_metrics(), all_logits)

    def _start_scoring(
        self,
        row: PackedRow,
        verifier_last_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor | None,
        ttt_steps: int,
        ttt_step_loss_decay: float,
        compute_dtype: torch.dtype,
        compiled: bool,
        output_logits: bool,
    ) -> ScoringPass:
        """The targets, the head in the compute dtype, and the positions every step scores."""
        if verifier_last_hidden_states.shape[:2] != (1, row.total):
            raise InvalidInputError(
                f"verifier_last_hidden_states must be [1, {row.total}, hidden], got "
                f"{tuple(verifier_last_hidden_states.shape)}"
            )
        # One row of targets per position plus `ttt_steps` spare rows, so that every step
        # reads an aligned [padded, vocab] view.
        pad = row.padded - row.total
        spare = F.pad(verifier_last_hidden_states[0], (0, 0, 0, pad + ttt_steps))
        targets = self.target_logits(spare)
        del spare
        target_ids = targets.argmax(dim=-1)
        self.lm_head.mark_read()  # after the targets' matmul: a gather may overlap it
        head_trained = torch.is_grad_enabled() and self.lm_head.weight.requires_grad
        scoring = ScoringPass.start(
            targets=targets,
            target_ids=target_ids,
            loss_mask=loss_mask,
            documents=row.documents,
            total=row.total,
            padded=row.padded,
            steps=ttt_steps,
            loss_decay=ttt_step_loss_decay,
            chunk_size=self.loss_chunk_size,
            compiled=compiled,
            head_compute=self.lm_head.weight.detach().to(compute_dtype),
            head_grad=WeightGradSink() if head_trained else None,
        )
        if (
            self._skipping_unused_positions(row.device)
            and len(self.layers) == 1
            and not output_logits
        ):
            scoring.select_used_positions()
        return scoring

    def _score_step(self, scoring: ScoringPass, step: int, normed: torch.Tensor) -> torch.Tensor:
        """Score TTT step `step`; returns its draft argmax `[padded]`."""
        # The head's gradient goes through the last step's loss alone (`WeightGradSink`):
        # complete at the start of the backward pass, and reducible from there on.
        head_weight = self.lm_head.weight
        if step == scoring.steps - 1:
            normed = self.lm_head.mark_read(normed)
        elif scoring.head_grad is not None:
            head_weight = head_weight.detach()
        if self._skipping_unscored_rows(normed.device):
            # Read here, with step 0's layer queued: the device is busy meanwhile.
            scoring.count_scored_positions()
        return scoring.score(step, normed, head_weight)

    def _next_input_ids(
        self, row: PackedRow, predicted: torch.Tensor, step: int, off_policy: bool
    ) -> torch.Tensor:
        """The tokens step `step + 1` feeds: the ground truth shifted (`off_policy`), else the
        draft's own argmax `predicted` `[1, padded]` mapped to target ids."""
        if off_policy:
            shift = min(step + 1, row.padded)
            return torch.cat([row.input_ids[:, shift:], row.input_ids.new_zeros(1, shift)], dim=-1)
        fed = predicted.clamp(min=0)  # -1: a position no later step reads
        return fed + self.d2t[fed]

    def fuse_aux_states(self, states: torch.Tensor) -> torch.Tensor:
        """The fused target state of step 0: `fc` of the auxiliary states, behind the fusion
        norms the config asks for (`fusion`)."""
        return fuse_aux_states(states, self.fc, self.input_norm, self.fc_norm)

    def final_norm(
        self, hidden: torch.Tensor, dtype: torch.dtype, compiled: bool = False
    ) -> torch.Tensor:
        """The draft's final norm of `hidden`, in `dtype` (the head's input)."""
        return maybe_compiled(_final_norm, compiled)(self, hidden, dtype)

    def run_layers(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Any,
        cache: Any,
        weight_cache: FirstLayerWeightCache,
        positions: torch.Tensor | None = None,
        keys_everywhere: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One TTT step through the decoder layers: the first reads the token embeddings beside
        the hidden state, the later ones (if any) are plain Llama layers on the same cache.
        `positions` / `keys_everywhere`: see `LlamaDecoderEagle3FirstLayer.ttt_step` (one layer
        only)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        first_layer, *later_layers = self.layers
        if positions is not None and later_layers:
            raise InvalidInputError("only a one-layer draft runs over a subset of positions")
        hidden = first_layer(
            hidden,
            input_embeds=embeds,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            past_key_values=cache,
            weight_cache=weight_cache,
            positions=positions,
            keys_everywhere=keys_everywhere,
            **kwargs,
        )
        for layer in later_layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        return hidden

    @torch.no_grad()
    def draft_argmax(self, normed: torch.Tensor) -> torch.Tensor:
        """Argmax of the draft logits of the normed states `normed`, `loss_chunk_size` rows at a
        time (draft ids)."""
        self.lm_head.mark_read()
        weight = self.lm_head.weight.to(normed.dtype)
        return torch.cat(
            [(part @ weight.T).argmax(-1) for part in normed.split(self.loss_chunk_size)]
        )

    def fuse_verifier_states(self, verifier_hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The draft's input from transformers' `output_hidden_states` (entry i is the input of
        decoder layer i, as vLLM counts `eagle_aux_hidden_state_layer_ids`): the auxiliary
        layers' states side by side, in the dtype of `fc`."""
        layer_ids = self.config.eagle_aux_hidden_state_layer_ids
        if not layer_ids:
            # vLLM's default for EAGLE-3
            layer_ids = eagle3_aux_layer_ids(len(verifier_hidden_states) - 1)
        fused = torch.cat([verifier_hidden_states[i] for i in layer_ids], dim=-1)
        return fused.to(self.fc.weight.dtype)

    def incremental_proposer(self, count: int) -> Eagle3Proposer:
        """An `Eagle3Proposer`: the proposals of `propose_tokens`, batched over rows and run
        only over the positions accepted since the last round (the `hf` eval engine uses it)."""
        return Eagle3Proposer(self, count)

    @torch.no_grad()
    def propose_tokens(
        self, verifier_hidden_states: tuple[torch.Tensor, ...], tokens: torch.Tensor, count: int
    ) -> torch.Tensor:
        """Draft `count` tokens after `tokens` from the verifier's hidden states.

        `verifier_hidden_states` are transformers' `output_hidden_states` (see
        `fuse_verifier_states`) for every position but the last; position t pairs the states of
        token t with token t + 1.
        """
        fused = self.fuse_verifier_states(verifier_hidden_states)
        length = fused.shape[1]
        shifted = tokens[:, 1 : length + 1]
        output = self(fused, shifted.to(fused.device), ttt_steps=count)
        draft_ids = torch.stack([step[0, -1] for step in output.draft_tokens])
        return draft_ids + self.d2t[draft_ids]
