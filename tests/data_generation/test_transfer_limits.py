"""Shared-memory transfer files: the root is chosen by the user, space is reserved up front, and
the orphan sweep removes only folders whose owner is gone."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from speculators_vllm016.data_generation.transfer import (
    TRANSFER_ROOT_ENV,
    TransferDir,
    TransferSpaceError,
    check_transfer_space,
    resolve_transfer_root,
)


def test_root_comes_from_the_flag_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(TRANSFER_ROOT_ENV, str(tmp_path / "env"))
    assert resolve_transfer_root(tmp_path / "flag") == tmp_path / "flag"
    assert resolve_transfer_root() == tmp_path / "env"
    (tmp_path / "env").mkdir()
    transfer = TransferDir()
    try:
        assert transfer.path.parent == tmp_path / "env"
    finally:
        transfer.cleanup()


def test_space_is_reserved_up_front_and_a_full_root_is_a_clear_error(tmp_path):
    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    transfer = TransferDir(root)
    try:
        transfer.allocate("small", 1 << 20)
        assert os.stat(transfer.file_for("small")).st_blocks * 512 >= 1 << 20  # not sparse
        too_big = 2 * shutil.disk_usage(root).total  # refused at once, nothing is allocated
        with pytest.raises(TransferSpaceError, match="--shm-size.*--transfer-root"):
            transfer.allocate("huge", too_big)
        assert not transfer.file_for("huge").exists()
    finally:
        transfer.cleanup()


class _Options:
    transfer_root = None
    dtype = "bfloat16"
    seq_length = 1 << 40


class _Facts:
    layer_ids = [1, 2, 3]
    hidden_size = 4096
    config_dict: dict = {}


def test_a_root_too_small_for_one_sample_is_refused_before_any_work(tmp_path):
    options = _Options()
    options.transfer_root = str(tmp_path)
    with pytest.raises(ValueError, match="Docker's default /dev/shm is 64 MiB"):
        check_transfer_space(options, _Facts())
    options.transfer_root = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a writable folder"):
        check_transfer_space(options, _Facts())


def test_sweep_keeps_live_and_foreign_folders_and_removes_dead_ones(tmp_path):
    # A user's folder that happens to match the name pattern, with a PID nobody has.
    users = tmp_path / "speculators-999999-mine"
    users.mkdir()
    (users / "keep.txt").write_text("mine")
    # Another container's live transfer dir: its PID is not visible here, but its lock is held.
    live = tmp_path / "speculators-999998-abc"
    live.mkdir()
    held = os.open(live / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    # A dead owner's dir: lock file present, nobody holds it.
    dead = tmp_path / "speculators-999997-def"
    dead.mkdir()
    (dead / ".lock").touch()
    (dead / "c0-1.bin").write_bytes(b"x" * 10)
    try:
        transfer = TransferDir(tmp_path)
        transfer.cleanup()
        assert (users / "keep.txt").read_text() == "mine"
        assert live.is_dir()
        assert not dead.exists()
    finally:
        os.close(held)
