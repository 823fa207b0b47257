"""`convert_model`: one entry point for every supported research checkpoint layout."""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["convert_model"]

ALGORITHMS = ("eagle", "eagle3")


def convert_model(
    model: str,
    verifier: str,
    algorithm: Literal["eagle", "eagle3"],
    output_path: str = "converted",
    validate_device: str | None = None,
    **kwargs: Any,
) -> None:
    """Convert `model` (local folder or hub id) into a speculator folder at `output_path`.

    algorithm "eagle": EAGLE-1/2 and HASS releases; kwargs `layernorms`, `fusion_bias`
    (both auto-detected from the weights when not set).
    algorithm "eagle3": EAGLE-3 releases; kwargs `norm_before_residual`,
    `eagle_aux_hidden_state_layer_ids`.
    A `validate_device` (any value) reloads the result after saving to check it.
    """
    from speculators_vllm016.convert.eagle import Eagle3Converter, EagleConverter

    if algorithm not in ALGORITHMS:
        raise ValueError(f"unsupported algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if not verifier:
        raise ValueError("a verifier (the target model id or path) is required")
    converter = EagleConverter() if algorithm == "eagle" else Eagle3Converter()
    converter.convert(
        model, output_path, verifier, validate=validate_device is not None, **kwargs
    )
