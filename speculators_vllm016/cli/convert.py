"""`speculators convert`: turn a research EAGLE/HASS/EAGLE-3 checkpoint into a speculator folder."""

from __future__ import annotations

import json

import typer

__all__ = ["convert"]


def convert(
    model: str = typer.Argument(..., help="Checkpoint to convert: local folder or hub id."),
    verifier: str = typer.Option(
        ..., "--verifier", help="The target (verifier) model: local folder or hub id."
    ),
    algorithm: str = typer.Option(..., "--algorithm", help="Checkpoint family: eagle or eagle3."),
    output_path: str = typer.Option(
        "converted", "--output-path", help="Folder to write config.json + model.safetensors to."
    ),
    validate_device: str | None = typer.Option(
        None, "--validate-device", help="If set, reload the result to validate it."
    ),
    algorithm_kwargs: str | None = typer.Option(
        None,
        "--algorithm-kwargs",
        help='JSON object of converter options, e.g. \'{"layernorms": true}\' (eagle) or '
        '\'{"norm_before_residual": true, "eagle_aux_hidden_state_layer_ids": [1, 23, 44]}\'.',
    ),
) -> None:
    """Convert a research checkpoint (EAGLE-1/2, HASS, EAGLE-3) to the speculators format."""
    from speculators_vllm016.convert.entrypoints import ALGORITHMS, convert_model

    if algorithm not in ALGORITHMS:
        raise typer.BadParameter(
            f"{algorithm!r} is not one of {ALGORITHMS}", param_hint="--algorithm"
        )
    kwargs: dict = {}
    if algorithm_kwargs:
        try:
            kwargs = json.loads(algorithm_kwargs)
        except json.JSONDecodeError as err:
            raise typer.BadParameter(f"not valid JSON: {err}", param_hint="--algorithm-kwargs")
        if not isinstance(kwargs, dict):
            raise typer.BadParameter("must be a JSON object", param_hint="--algorithm-kwargs")
    convert_model(
        model=model,
        verifier=verifier,
        algorithm=algorithm,  # type: ignore[arg-type]
        output_path=output_path,
        validate_device=validate_device,
        **kwargs,
    )
