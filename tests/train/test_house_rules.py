"""House rules a reader relies on: no package file over 650 lines, no function in `train/` over 80.

A file past 650 lines usually holds two concepts; a function past 80 lines, several steps that
deserve names. Counted as `ast` sees them: a function's lines run from its `def` to its last
statement (docstring included), nested functions count inside their parent too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (REPO / "speculators_vllm016", REPO / "speculators")
TRAIN = REPO / "speculators_vllm016" / "train"
MAX_FILE_LINES = 650
MAX_FUNCTION_LINES = 80


def _long_files(folders: tuple[Path, ...], limit: int) -> list[str]:
    return [
        f"{path.relative_to(REPO)}: {count} lines"
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > limit
    ]


def _long_functions(folder: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                count = node.end_lineno - node.lineno + 1
                if count > limit:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {count}")
    return found


def test_no_package_file_over_650_lines():
    assert _long_files(PACKAGES, MAX_FILE_LINES) == []


def test_no_function_in_train_over_80_lines():
    assert _long_functions(TRAIN, MAX_FUNCTION_LINES) == []
