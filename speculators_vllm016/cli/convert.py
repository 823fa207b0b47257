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
        "converted",
        "--output-path",
        help="Folder to write config.json + model.safetensors to (created whole or not at all).",
    ),
    validate_device: str | None = typer.Option(
        None,
        "--validate-device",
        help="If set (cpu, cuda, cuda:1, ...), reload the result on that device and compare "
        "every tensor before publishing it.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a non-empty --output-path (never the inputs)."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
    source: str | None = typer.Option(
        None,
        "--source",
        help="eagle3: the tool that wrote the draft (research = SafeAILab/SpecForge, torchspec, "
        "modelopt); its documented mapping gives the fused layers in vLLM's numbering and the "
        "residual placement (docs/converting.md). Default: recognized from config.json.",
    ),
    algorithm_kwargs: str | None = typer.Option(
        None,
        "--algorithm-kwargs",
        help="JSON object of converter options, e.g. '{\"layernorms\": true}' (eagle) or "
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
            raise typer.BadParameter(
                f"not valid JSON: {err}", param_hint="--algorithm-kwargs"
            ) from None
        if not isinstance(kwargs, dict):
            raise typer.BadParameter("must be a JSON object", param_hint="--algorithm-kwargs")
    if source is not None:
        from speculators_vllm016.convert.eagle3_sources import SOURCES

        if algorithm != "eagle3" or source not in SOURCES:
            raise typer.BadParameter(
                f"{source!r}: --source takes one of {SOURCES}, with --algorithm eagle3",
                param_hint="--source",
            )
        kwargs["source"] = source
    from speculators_vllm016.utils.command_errors import report_errors

    def run() -> int:
        convert_model(
            model=model,
            verifier=verifier,
            algorithm=algorithm,  # type: ignore[arg-type]
            output_path=output_path,
            validate_device=validate_device,
            overwrite=overwrite,
            **kwargs,
        )
        typer.echo(f"Converted {model} into {output_path}")
        return 0

    code = report_errors(run, debug)
    if code:
        raise typer.Exit(code)
