"""The draft a training job starts from: its config shaped like the verifier, its first weights.

`build_draft_config` makes a fresh EAGLE-3 draft's config (a Llama decoder layer the verifier's
width); `build_model` builds the draft of a prepared job (`setup.prepare`): seeded, or the
`--from-pretrained` draft's weights exactly. The checks that come before are `setup`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.draft_match import eagle31_flags
from speculators_vllm016.train.jobs.job_config import TrainJobConfig
from speculators_vllm016.train.jobs.pretrained_draft import fine_tune_config, load_draft_weights
from speculators_vllm016.train.jobs.verifier_identity import recorded_verifier_path
from speculators_vllm016.utils.draft_positions import draft_positions
from speculators_vllm016.utils.errors import InvalidInputError

if TYPE_CHECKING:
    from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators_vllm016.train.jobs.setup import TrainSetup

__all__ = ["build_draft_config", "build_model"]


def build_draft_config(
    verifier_path: str,
    verifier_config: Any,
    text_config: Any,
    *,
    draft_vocab: int,
    num_layers: int,
    norm_before_residual: bool,
    ttt_steps: int,
    aux_layer_ids: list[int] | None,
    verifier_fingerprint: str | None = None,
    sliding_window: int | None = None,
    eagle31: dict[str, bool] | None = None,
    draft_arch: str = "llama",
) -> Eagle3SpeculatorConfig:
    """The EAGLE-3 draft's config: a Llama decoder layer shaped like the verifier, with the
    verifier's positions in the form vLLM serves as trained (`utils.draft_positions`),
    `sliding_window` written as vLLM 0.16 reads it (every draft layer `sliding_attention`), and
    `eagle31`: the EAGLE-3.1 switches by config key (`draft_match.eagle31_flags`), all off if None;
    or with `draft_arch="mla"` a DeepSeek MLA layer shaped from it (`mla_layer_config`), which has
    neither a window nor the EAGLE-3.1 norms."""
    from speculators_vllm016.models.eagle3 import Eagle3SpeculatorConfig

    if draft_arch == "mla":
        from speculators_vllm016.models.eagle3.mla_layout import MLA_ARCHITECTURE, mla_layer_config

        model_type = getattr(verifier_config, "model_type", None)
        layer = mla_layer_config(text_config, num_layers=num_layers, verifier_model_type=model_type)
        by_arch: dict[str, Any] = {"architectures": [MLA_ARCHITECTURE]}
    else:
        layer = _llama_layer_config(text_config, num_layers, ttt_steps, sliding_window)
        by_arch = dict(eagle31 or {})
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual,
        target_hidden_size=getattr(text_config, "hidden_size", None),
        eagle_aux_hidden_state_layer_ids=aux_layer_ids,
        speculators_config=_speculators_config(
            verifier_path, verifier_config, ttt_steps, verifier_fingerprint
        ),
        **by_arch,
    )


def _llama_layer_config(
    text_config: Any, num_layers: int, ttt_steps: int, sliding_window: int | None
) -> Any:
    """The Llama decoder layer shaped like the verifier, with its positions and window."""
    from transformers import LlamaConfig

    get = lambda name, default=None: getattr(text_config, name, default)  # noqa: E731
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    llama_like = get("model_type") in {"llama", "mistral", "qwen2", "qwen3"}
    head_dim = (get("head_dim") if llama_like else None) or hidden // heads
    positions = draft_positions(text_config, head_dim)
    window: dict[str, Any] = {}
    if sliding_window is not None:
        if sliding_window < ttt_steps:
            raise InvalidInputError(
                f"--sliding-window {sliding_window} is shorter than --ttt-steps {ttt_steps}: the "
                "last steps would see no context; give a window of at least the TTT steps"
            )
        window = {
            "layer_types": ["sliding_attention"] * num_layers,
            "sliding_window": sliding_window,
        }
    return LlamaConfig(
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=positions.max_position_embeddings,
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        rope_theta=positions.rope_theta,
        rope_scaling=positions.rope_scaling,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **window,
    )


def _speculators_config(
    verifier_path: str,
    verifier_config: Any,
    ttt_steps: int,
    verifier_fingerprint: str | None = None,
) -> Any:
    """The draft's `speculators_config`: greedy proposals of `ttt_steps` tokens, for this verifier."""
    from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
    from speculators_vllm016.proposals import GreedyTokenProposalConfig

    return SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(
            name_or_path=verifier_path,
            architectures=list(getattr(verifier_config, "architectures", None) or []),
            weights_fingerprint=verifier_fingerprint,
        ),
    )


def build_model(config: TrainJobConfig, setup: TrainSetup) -> Eagle3DraftModel:
    """The draft with its initial weights: seeded by --seed, or the `--from-pretrained` draft's
    exactly (the verifier's final norm and LM head rows, which drafts do not hold, are read
    from the verifier either way). What training starts from."""
    import torch

    from speculators_vllm016.models.eagle3 import Eagle3DraftModel

    model_config = config.model
    torch.manual_seed(config.training.seed)
    verifier_path = recorded_verifier_path(model_config.verifier_name_or_path)
    if setup.pretrained is not None:
        draft_config = fine_tune_config(
            setup.pretrained,
            _speculators_config(
                verifier_path,
                setup.verifier_config,
                model_config.ttt_steps,
                setup.verifier_fingerprint,
            ),
            setup.aux_ids,
            sliding_window=model_config.sliding_window,
        )
    else:
        draft_config = build_draft_config(
            verifier_path,
            setup.verifier_config,
            setup.text_config,
            draft_vocab=int(setup.vocab.d2t.shape[0]),
            num_layers=model_config.num_layers,
            norm_before_residual=model_config.norm_before_residual,
            ttt_steps=model_config.ttt_steps,
            aux_layer_ids=setup.aux_ids,
            verifier_fingerprint=setup.verifier_fingerprint,
            sliding_window=model_config.sliding_window,
            eagle31=eagle31_flags(model_config),
            draft_arch=model_config.draft_arch,
        )
    model_kwargs = {}
    if config.legacy.no_verifier_norm:
        model_kwargs["use_verifier_norm"] = False
    model = Eagle3DraftModel(
        draft_config,
        t2d=setup.vocab.t2d,
        d2t=setup.vocab.d2t,
        verifier=setup.verifier,
        **model_kwargs,
    )
    if setup.verifier is not None:
        setup.verifier.release_tensors()  # the draft holds its copies now
    if setup.pretrained is not None:
        load_draft_weights(model, setup.pretrained)
    # Training reads only the loss: on CUDA each TTT step's layer skips the positions
    # whose output no loss term or metric reads (the draft tokens there are not needed).
    model.skip_unused_positions = None
    # Every row padded to --total-seq-len (flex only): one compiled shape for the whole run.
    model.flex_row_length = config.training.total_seq_len
    return model
