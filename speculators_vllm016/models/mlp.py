"""Config of MLP speculators (IBM-style multi-head MLP drafts), kept for checkpoint compatibility.

Only the config exists: it describes such checkpoints; there is no model class here.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field

from speculators_vllm016.config import SpeculatorModelConfig

__all__ = ["MLPSpeculatorConfig"]


# The `torch_dtype` field deliberately replaces PretrainedConfig's deprecated alias property.
warnings.filterwarnings("ignore", message='Field name "torch_dtype"', category=UserWarning)


@SpeculatorModelConfig.register("mlp")
class MLPSpeculatorConfig(SpeculatorModelConfig):
    """An MLP draft: per-step MLP heads over the verifier's embeddings and last hidden state."""

    speculators_model_type: str = "mlp"
    architectures: list[str] = Field(
        default_factory=lambda: ["MLPSpeculator"], description="Classes that load the weights."
    )
    torch_dtype: str = Field(default="bfloat16", description="Dtype of the draft's weights.")
    inputs: list[str] = Field(
        default_factory=lambda: ["input_embeddings", "hidden_states[-1]"],
        description="Verifier outputs the draft reads.",
    )
    inputs_hidden_states_normalized: bool = Field(
        default=False,
        description="True: the verifier hidden states are taken after its final norm.",
    )
    hidden_size: int = Field(default=4096, description="Verifier hidden size.")
    intermediate_size: int = Field(default=4096, description="Width of the MLP heads.")
    vocab_size: int = Field(default=128256, description="Vocabulary the draft predicts over.")
    num_layers: int = Field(
        default=5, description="MLP heads; also the most tokens drafted per step."
    )
    tie_weights: bool = Field(
        default=True, description="Share embeddings, projections and heads across the layers."
    )

    def __init__(self, **kwargs: Any) -> None:
        # transformers >= 4.56 made `torch_dtype` a property aliasing `dtype`; hand the value
        # over as `dtype` too so that reading the field during construction finds it.
        given = kwargs.pop("torch_dtype", None), kwargs.pop("dtype", None)
        dtype = given[0] or given[1] or "bfloat16"
        if not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")
        super().__init__(torch_dtype=dtype, dtype=dtype, **kwargs)
