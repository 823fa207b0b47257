"""Which dimensions of a compiled block's arguments stay symbolic from its first call.

`model_definitions.maybe_compiled` compiles each block once per process. A block whose
arguments change size along one dimension from call to call (the layer's rows over a subset of
positions, the fused loss's shorter last chunk) would compile again for the first new size;
marked symbolic before every call, that dimension never does, and the others stay fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SymbolicMarks", "compile_symbolic", "mark_rows", "marked", "registered_marks"]

SymbolicMarks = Callable[[tuple[Any, ...]], None]
"""Marks the dimensions of a block's arguments that its compiled graph keeps symbolic."""

_REGISTERED: dict[Callable, SymbolicMarks] = {}


def compile_symbolic(function: Callable, marks: SymbolicMarks) -> None:
    """Have `maybe_compiled(function)` keep the dimensions `marks` marks symbolic from its first
    call (the layer's row blocks with `mark_rows`, the fused loss's KL blocks with their own)."""
    _REGISTERED[function] = marks


def registered_marks(function: Callable) -> SymbolicMarks | None:
    """The marks `compile_symbolic` registered for `function`, if any."""
    return _REGISTERED.get(function)


def marked(block: Callable, marks: SymbolicMarks) -> Callable:
    """`block` with `marks` applied to its arguments before every call: those dimensions are
    symbolic from the first call on, the others fixed (a new size of them compiles nothing)."""

    def call(*args: Any) -> Any:
        marks(args)
        return block(*args)

    return call


def mark_rows(args: tuple[Any, ...]) -> None:
    """The row length (dim 1 of every `[B, L, ...]` argument) symbolic.

    A row whose layer runs over a subset of its positions (`skip_unused_positions`) hands the
    row blocks `[B, n, ...]` tensors, n new for every step and row. Compiled for the first row's
    fixed length, the first such row compiled every block again (6.8 s on an H100 at the
    Kimi-K2.5 draft's shapes); compiled symbolic in L from the start, it compiles nothing.
    The blocks work row by row (norms over the hidden size, element-wise products), so a
    kernel's sums within a row do not depend on how many rows it is launched over.
    """
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() >= 3:
            torch._dynamo.maybe_mark_dynamic(arg, 1)
