"""`--help` of the typer commands (eval, convert, vocab-mapping) in the argparse layout.

datagen, train, demo and gen-and-train parse with argparse (0.3.0's scripts did), so their help is
argparse's. The typer commands keep typer's parsing (their flags, defaults and checks stay exactly
as they are) and only their help page is rebuilt as an argparse parser and printed by argparse's
own formatter, so that every command's help has one layout.
"""

from __future__ import annotations

import argparse
from typing import Any

from typer.core import TyperCommand

__all__ = ["ARGPARSE_HELP_STYLE", "ArgparseHelpCommand", "argparse_parser_for"]


class ArgparseHelpCommand(TyperCommand):
    """A typer command whose `--help` is argparse's page for the same options."""

    def get_help(self, ctx: Any) -> str:
        return argparse_parser_for(self, f"speculators {ctx.info_name}").format_help()


# `app.command(..., **ARGPARSE_HELP_STYLE)`; `-h` too, as the argparse commands take it.
ARGPARSE_HELP_STYLE: dict[str, Any] = {
    "cls": ArgparseHelpCommand,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}


def argparse_parser_for(command: TyperCommand, prog: str) -> argparse.ArgumentParser:
    """An argparse parser holding the command's arguments and options, used only for its help."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(command.help or "").strip() or None,
        epilog=command.epilog,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        help_text = _escaped(getattr(param, "help", None))
        # Typer vendors its own click: told apart by click's `param_type_name`, not by class.
        if param.param_type_name == "argument":
            parser.add_argument(param.name.upper(), help=help_text)
            continue
        names = [*param.opts, *param.secondary_opts]
        if param.is_flag:
            parser.add_argument(*names, action="store_true", default=param.default, help=help_text)
        else:
            parser.add_argument(
                *names,
                action="append" if param.multiple else "store",
                required=param.required,
                default=None if param.multiple and not param.default else param.default,
                help=help_text,
            )
    return parser


def _escaped(text: str | None) -> str | None:
    """argparse %-formats help strings: a literal % must be doubled."""
    return None if text is None else text.replace("%", "%%")
