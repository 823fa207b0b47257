"""Counting the files a job's set-up opens (#49 item 2: each input read once).

`counting(folders)` wraps the functions that open files (`open`, `safetensors.safe_open`,
`torch.load`) for the block and keeps each opening of a file inside one of the watched folders
as `label:relative/path`, with the stack that opened it. An opening is put down to the library
that made it where one did it on its own account: vLLM (its config and tokenizer reading),
transformers (a tokenizer's or config's files) or datasets; every other opening is ours. Our code
asking a library to read a file again (say, `PretrainedConfig.get_config_dict`) still shows as
that library's: each test pins every bucket, so a second reading shows either way."""

from __future__ import annotations

import builtins
import contextlib
import io
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors
import torch

# Where each library's frames live, in the order an opening is put down to one (vLLM calls
# transformers: an opening under both is vLLM's).
LIBRARIES = (("vllm", "/vllm/"), ("transformers", "/transformers/"), ("datasets", "/datasets/"))


class Openings:
    """Readings of files (or a watched file itself) under the watched folders, per library (`ours` for our own code)."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = {label: Path(folder).resolve() for label, folder in folders.items()}
        self.by: dict[str, Counter[str]] = {"ours": Counter()}
        self.by.update({name: Counter() for name, _ in LIBRARIES})
        self.stacks: dict[str, list[str]] = {}

    @property
    def ours(self) -> Counter[str]:
        return self.by["ours"]

    @property
    def vllm(self) -> Counter[str]:
        return self.by["vllm"]

    def note(self, file: object, mode: str = "r") -> None:
        if any(flag in mode for flag in "wax"):
            return  # written, not read
        try:
            path = Path(file).resolve()  # type: ignore[arg-type]
        except TypeError:
            return
        for label, folder in self.folders.items():
            if folder == path or folder in path.parents:
                key = label if path == folder else f"{label}:{path.relative_to(folder)}"
                frames = traceback.extract_stack()[:-2]
                owner = next(
                    (
                        name
                        for name, marker in LIBRARIES
                        if any(marker in frame.filename for frame in frames)
                    ),
                    "ours",
                )
                self.by[owner][key] += 1
                self.stacks.setdefault(key, []).append("".join(traceback.format_list(frames[-14:])))
                return

    def why(self, key: str) -> str:
        return "\n---\n".join(self.stacks.get(key, []))

    def counts(self) -> dict[str, dict[str, int]]:
        """{library: {file: openings}} without empty buckets (for pinning and printing)."""
        return {owner: dict(sorted(seen.items())) for owner, seen in self.by.items() if seen}


@contextlib.contextmanager
def counting(folders: dict[str, Path]) -> Iterator[Openings]:
    seen = Openings(folders)
    real_open, real_safe_open, real_load = builtins.open, safetensors.safe_open, torch.load

    def opened(file, mode="r", *args, **kwargs):
        seen.note(file, mode)
        return real_open(file, mode, *args, **kwargs)

    def safe_opened(file, *args, **kwargs):
        seen.note(file)
        return real_safe_open(file, *args, **kwargs)

    def loaded(file, *args, **kwargs):
        seen.note(file)
        return real_load(file, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(builtins, "open", opened)
        patch.setattr(io, "open", opened)
        patch.setattr(safetensors, "safe_open", safe_opened)
        # transformers loads weights through its own name for it (imported before the patch).
        from transformers import modeling_utils

        patch.setattr(modeling_utils, "safe_open", safe_opened)
        patch.setattr(torch, "load", loaded)
        yield seen
    finally:
        patch.undo()


def assert_counts(seen: Openings, expected: dict[str, dict[str, int]]) -> None:
    """Every bucket's openings are exactly `expected` ({library: {file: openings}})."""
    for owner in {*expected, *seen.by}:
        want = expected.get(owner, {})
        got = seen.by.get(owner, Counter())
        for key in {*want, *got}:
            assert got[key] == want.get(key, 0), (
                f"{owner} opened {key} {got[key]} times, expected {want.get(key, 0)}\n"
                f"{seen.why(key)}"
            )
