"""`convert_model`: one entry point for every supported research checkpoint layout."""

from __future__ import annotations

from typing import Any, Literal

from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["convert_model"]

ALGORITHMS = ("eagle", "eagle3")


def convert_model(
    model: str,
    verifier: str,
    algorithm: Literal["eagle", "eagle3"],
    output_path: str = "converted",
    validate_device: str | None = None,
    overwrite: bool = False,
    **kwargs: Any,
) -> None:
    """Convert `model` (local folder or hub id) into a speculator folder at `output_path`.

    algorithm "eagle": EAGLE-1/2 and HASS releases; kwargs `layernorms`, `fusion_bias`
    (both auto-detected from the weights when not set).
    algorithm "eagle3": EAGLE-3 releases; kwargs `norm_before_residual`,
    `eagle_aux_hidden_state_layer_ids` and `source` (the tool that wrote the draft, see
    `convert/eagle3_sources`: research/SpecForge, torchspec, modelopt; recognized when not given).
    A `validate_device` reloads the result on that device ("cpu", "cuda:0", ...) and compares
    every tensor. The result appears at `output_path` only when whole and checked; the model's and
    the verifier's folders are refused, and a non-empty folder unless `overwrite`.
    """
    from speculators_vllm016.convert.eagle import EagleConverter
    from speculators_vllm016.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators_vllm016.convert.output import check_output_path, staged_output

    if algorithm not in ALGORITHMS:
        raise InvalidInputError(f"unsupported algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if not verifier:
        raise InvalidInputError("a verifier (the target model id or path) is required")
    target = check_output_path(output_path, [model, verifier], overwrite)
    converter = EagleConverter() if algorithm == "eagle" else Eagle3Converter()
    with staged_output(target) as stage:
        converter.convert(
            model,
            stage,
            verifier,
            validate=validate_device is not None,
            validate_device=validate_device or "cpu",
            **kwargs,
        )
