"""The one atomic-write helper: whole or nothing, one temporary-name scheme."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from speculators_vllm016.utils.atomic_files import (
    TEMP_SUFFIX,
    atomic_torch_save,
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    replace_folder,
    torch_save,
)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")

    def fail(handle):
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


def test_writes_land_whole_under_the_final_name(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "hello", fsync=True)
    atomic_write_json(tmp_path / "b.json", {"x": 1})
    atomic_torch_save({"t": torch.arange(3)}, tmp_path / "c.pt")
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert json.loads((tmp_path / "b.json").read_text()) == {"x": 1}
    assert torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["t"], torch.arange(3))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TEMP_SUFFIX)]


def test_the_temporary_file_is_hidden_beside_the_target(tmp_path):
    seen = []
    atomic_write(tmp_path / "x.pt", lambda handle: seen.append(handle.name))
    assert seen[0].startswith(str(tmp_path / ".x.pt."))
    assert seen[0].endswith(TEMP_SUFFIX)


def test_replace_folder_swaps_an_existing_folder(tmp_path):
    old, new = tmp_path / "ckpt", tmp_path / "stage"
    old.mkdir()
    (old / "f").write_text("old")
    new.mkdir()
    (new / "f").write_text("new")
    replace_folder(new, old)
    assert (old / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_torch_save_reports_a_full_disk_as_itself():
    # torch's zip writer turns the failed write into "unexpected pos"; the kept error comes back.
    with pytest.raises(OSError) as caught:
        torch_save({"t": torch.zeros(1 << 16)}, "/dev/full")
    assert caught.value.errno == errno.ENOSPC


def _folder(path, content: str):
    path.mkdir()
    (path / "a").write_text(content)
    (path / "b").write_text(content)
    return path


def test_a_failed_second_rename_puts_the_old_folder_back_under_its_name(tmp_path, monkeypatch):
    import os

    from speculators_vllm016.utils import atomic_files

    target, source = _folder(tmp_path / "ckpt", "old"), _folder(tmp_path / "stage", "new")
    renames = []
    real_replace = os.replace

    def second_fails(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise OSError(errno.EIO, "rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", second_fails)
    with pytest.raises(OSError, match="rename failed"):
        replace_folder(source, target, fsync=False)
    monkeypatch.undo()
    assert renames[1] == (source, target)  # the failure hit the second rename itself
    assert (target / "a").read_text() == (target / "b").read_text() == "old"
    assert (source / "a").read_text() == "new"  # the new content is not lost either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "stage"]


def test_restore_puts_back_only_a_folder_whose_name_is_empty(tmp_path):
    from speculators_vllm016.utils.atomic_files import restore_replaced_folder

    aside = _folder(tmp_path / ".old-ckpt", "old")
    assert restore_replaced_folder(tmp_path / "ckpt", aside)
    assert (tmp_path / "ckpt" / "a").read_text() == "old" and not aside.exists()
    aside = _folder(tmp_path / ".old-ckpt", "older")  # the swap finished: a leftover
    assert not restore_replaced_folder(tmp_path / "ckpt", aside)
    assert (tmp_path / "ckpt" / "a").read_text() == "old" and aside.exists()


def test_a_model_folder_gets_the_modes_a_plain_open_gives(tmp_path):
    """safetensors' own writer leaves 0600; after `give_usual_modes` every file has the mode
    the umask allows (0644 under 022, 0640 under 027), as a json written with `open` has."""
    import os

    from safetensors.torch import save_file

    from speculators_vllm016.utils.atomic_files import give_usual_modes, usual_file_mode

    for umask, expected in ((0o022, 0o644), (0o027, 0o640)):
        folder = tmp_path / oct(umask)
        (folder / "sub").mkdir(parents=True)
        previous = os.umask(umask)
        try:
            save_file({"w": torch.zeros(2)}, str(folder / "sub" / "model.safetensors"))
            (folder / "config.json").write_text("{}")
            assert usual_file_mode() == expected
            give_usual_modes(folder)
        finally:
            os.umask(previous)
        modes = {p.name: p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}
        assert modes == {"model.safetensors": expected, "config.json": expected}
