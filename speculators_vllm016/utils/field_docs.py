"""The docstring written under each field of a dataclass, read from its source.

A job config documents every field where it is declared (torchtitan's style):

    @dataclass
    class Optim:
        lr: float = 1e-4
        \"\"\"Peak learning rate.\"\"\"

Python keeps no such string at run time; this reads them back from the class's source so that a
command line's help text and the config's documentation are the same words.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["field_docs"]


def field_docs(cls: type) -> dict[str, str]:
    """`{field: docstring}` for the fields of `cls` with a string literal right below them
    (whitespace folded into single spaces). Empty when the source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs
