"""The `speculators` command line (also `python -m speculators_vllm016`)."""

from __future__ import annotations

import typer

__all__ = ["app"]

app = typer.Typer(
    name="speculators",
    help="Train EAGLE-style speculative-decoding drafts; data generation on vLLM 0.16.",
    no_args_is_help=True,
    add_completion=False,
)

# Subcommands whose flags 0.3.0's scripts defined with argparse (e.g. `--layer-ids 2 16 29`)
# keep argparse: typer hands them the raw arguments.
_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def version_callback(value: bool) -> None:
    if value:
        from speculators_vllm016.version import __version__

        typer.echo(f"speculators-vllm016 {__version__}")
        raise typer.Exit()


@app.callback()
def speculators(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """Train EAGLE-style speculative-decoding drafts; data generation on vLLM 0.16."""


@app.command(context_settings=_PASSTHROUGH, add_help_option=False)
def datagen(ctx: typer.Context) -> None:
    """Generate EAGLE-3 training data (hidden states) from chat data. See `datagen --help`."""
    from speculators_vllm016.cli.datagen import main

    raise typer.Exit(main(ctx.args))


@app.command(context_settings=_PASSTHROUGH, add_help_option=False)
def regenerate(ctx: typer.Context) -> None:
    """Answer the chat data's assistant turns with the target itself (on-policy data). See `regenerate --help`."""
    from speculators_vllm016.cli.regenerate import main

    raise typer.Exit(main(ctx.args))


@app.command(context_settings=_PASSTHROUGH, add_help_option=False)
def demo(ctx: typer.Context) -> None:
    """The whole job on a tiny local model, offline: data, draft, measured acceptance. See `demo --help`."""
    from speculators_vllm016.demo.cli import main

    raise typer.Exit(main(ctx.args))


@app.command(context_settings=_PASSTHROUGH, add_help_option=False)
def train(ctx: typer.Context) -> None:
    """Train an EAGLE-3 draft on datagen's hidden states. See `train --help`."""
    from speculators_vllm016.cli.train import main

    raise typer.Exit(main(ctx.args))


@app.command(name="gen-and-train", context_settings=_PASSTHROUGH, add_help_option=False)
def gen_and_train(ctx: typer.Context) -> None:
    """Datagen, vocabulary maps and draft training, each resumable. See `gen-and-train --help`."""
    from speculators_vllm016.cli.gen_and_train import main

    raise typer.Exit(main(ctx.args))


def _register_convert() -> None:
    from speculators_vllm016.cli.convert import convert
    from speculators_vllm016.cli.help_style import ARGPARSE_HELP_STYLE

    app.command(name="convert", **ARGPARSE_HELP_STYLE)(convert)


def _register_evaluation() -> None:
    from speculators_vllm016.cli.eval import EPILOG, evaluate
    from speculators_vllm016.cli.help_style import ARGPARSE_HELP_STYLE
    from speculators_vllm016.cli.vocab_mapping import vocab_mapping

    # One help layout for every command: these parse with typer but print argparse's help page.
    app.command(name="eval", epilog=EPILOG, **ARGPARSE_HELP_STYLE)(evaluate)
    app.command(name="vocab-mapping", **ARGPARSE_HELP_STYLE)(vocab_mapping)


_register_convert()
_register_evaluation()

if __name__ == "__main__":
    app()
