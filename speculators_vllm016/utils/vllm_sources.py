"""Facts read from the installed vLLM's Python sources, without importing vLLM.

Importing vLLM's model classes to ask them a question costs tens of seconds on a small machine;
datagen and train only want to know, at start-up, what vLLM's own code says. Parsing the files
(`ast`) answers that in milliseconds and runs no vLLM code. Every reader returns None when the
source does not have the expected shape, so callers can say "unknown" instead of guessing.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

__all__ = [
    "class_implements",
    "eagle3_target_types",
    "registered_model_class",
    "vllm_package_dir",
    "vllm_version",
]


def vllm_package_dir() -> Path | None:
    """The installed `vllm` package folder (None when vLLM is not installed); imports nothing."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=64)
def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):
        return None


def vllm_version(root: Path) -> str:
    tree = _parse(root / "_version.py")
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in {"__version__", "version"} for t in node.targets
        ):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return "unknown"


def eagle3_target_types(root: Path) -> tuple[str, ...] | None:
    """The text model types `SpeculativeConfig` accepts for EAGLE-3 (the list as shipped)."""
    tree = _parse(root / "config" / "speculative.py")
    for node in ast.walk(tree) if tree else ():
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id == "eagle3_target_supported" for t in node.targets
            )
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            return tuple(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return None


def registered_model_class(root: Path, arch: str) -> tuple[str, str] | None:
    """`(module, class)` vLLM's registry maps `arch` to (module under model_executor/models)."""
    tree = _parse(root / "model_executor" / "models" / "registry.py")
    for node in ast.walk(tree) if tree else ():
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values):
            if (
                isinstance(key, ast.Constant)
                and key.value == arch
                and isinstance(value, ast.Tuple)
                and len(value.elts) == 2
                and all(isinstance(e, ast.Constant) for e in value.elts)
            ):
                return value.elts[0].value, value.elts[1].value
    return None


def class_implements(root: Path, module: str, class_name: str, interface: str) -> bool | None:
    """Whether the class (or a base class it inherits, followed across vLLM's model modules)
    lists `interface` among its bases. None when the class is not found."""
    models = root / "model_executor" / "models"
    seen: set[tuple[str, str]] = set()
    pending = [(module, class_name)]
    found_any = False
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        tree = _parse(models / f"{current[0]}.py")
        if tree is None:
            continue
        imported = {
            alias.asname or alias.name: (node.module.rsplit(".", 1)[-1], alias.name)
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            and node.module
            and (node.level == 1 or node.module.startswith("vllm.model_executor.models."))
            for alias in node.names
        }
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == current[1]:
                found_any = True
                for base in node.bases:
                    name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                    if name == interface:
                        return True
                    if name in imported:
                        pending.append(imported[name])
                    elif name:
                        pending.append((current[0], name))
    return False if found_any else None
