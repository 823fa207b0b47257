"""The draft's layer architecture (`--draft-arch`: the Llama layer or DeepSeek's MLA layer) against
the target, the other flags and a `--from-pretrained` draft; part of `setup.prepare`'s checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speculators_vllm016.train.jobs.job_config import TrainJobConfig, TrainSetupError

if TYPE_CHECKING:
    from speculators_vllm016.train.jobs.pretrained_draft import PretrainedDraft

__all__ = ["check_draft_arch", "check_pretrained_arch"]


def check_draft_arch(config: TrainJobConfig, text_config: Any) -> None:
    """`--draft-arch mla` needs a target with multi-head latent attention and one layer; the
    sliding window and EAGLE-3.1's norms are the Llama layer's (the MLA draft has none)."""
    model = config.model
    if model.draft_arch != "mla":
        return
    names = ("sliding_window", "fc_norm", "norm_output", "norm_before_fc")
    if given := [f"--{name.replace('_', '-')}" for name in names if getattr(model, name)]:
        draft = f" (--from-pretrained {model.from_pretrained})" if model.from_pretrained else ""
        raise TrainSetupError(
            f"{', '.join(given)}: Llama-layer draft options; not with --draft-arch mla{draft}: "
            "the MLA layer has none of them"
        )
    if model.from_pretrained:
        return
    from speculators_vllm016.models.eagle3.mla_layout import mla_layer_config

    try:
        mla_layer_config(text_config, num_layers=config.model.num_layers)
    except ValueError as error:
        raise TrainSetupError(str(error)) from None


def check_pretrained_arch(config: TrainJobConfig, pretrained: PretrainedDraft) -> None:
    """The `--from-pretrained` draft's layer is the one `--draft-arch` names."""
    from speculators_vllm016.models.eagle3.mla_layout import is_mla_layer_config

    arch = "mla" if is_mla_layer_config(pretrained.config.transformer_layer_config) else "llama"
    if arch != config.model.draft_arch:
        raise TrainSetupError(
            f"--from-pretrained {pretrained.source} is a {arch!r} draft; pass --draft-arch {arch}"
        )
