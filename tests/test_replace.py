"""Saving over an existing file: the old file freed off the caller's thread, and with
``durable=False`` the names swapped (``renameat2(RENAME_EXCHANGE)``) instead of a rename
that makes ext4 flush the new file (files/tempfiles.replace)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

import tdz_numba
from tdz_numba.files import libc
from tdz_numba.files import tempfiles as _tempfiles

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_PATH, renameat2: Linux")


def _names(d: Path) -> list[str]:
    return sorted(os.listdir(d))


class _Recorder:
    """``libc.function`` with ``renameat2`` wrapped: the flags of every call recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, result: int | None = None) -> None:
        self.flags: list[int] = []
        real = libc.function
        inner = real("renameat2")

        def fake_renameat2(olddir, old, newdir, new, flags):
            self.flags.append(flags)
            if result is not None:
                return result
            return inner(olddir, old, newdir, new, flags)

        monkeypatch.setattr(
            libc, "function", lambda name: fake_renameat2 if name == "renameat2" else real(name)
        )


@pytest.mark.parametrize("durable", [True, False])
def test_save_over_a_file_leaves_the_new_bytes_under_one_name_and_old_readers_intact(tmp_path, durable):
    p = tmp_path / "m.tdz"
    tdz_numba.save({"w": torch.arange(1000, dtype=torch.float32)}, p)
    old = tdz_numba.open(p)  # a reader of the old file: its mapping must keep the old bytes
    try:
        tdz_numba.save({"w": torch.full((1000,), 7.0), "b": torch.ones(3)}, p, durable=durable)
        assert _names(tmp_path) == ["m.tdz"]  # no temp name left, at once
        assert torch.equal(old["w"], torch.arange(1000, dtype=torch.float32))
    finally:
        old.close()
    new = tdz_numba.load(p)
    assert set(new) == {"w", "b"} and torch.equal(new["w"], torch.full((1000,), 7.0))
    assert _tempfiles.wait_released(10)


def test_not_durable_swaps_the_names_durable_renames(tmp_path, monkeypatch):
    rec = _Recorder(monkeypatch)
    p = tmp_path / "m.tdz"
    tdz_numba.save({"w": torch.zeros(10)}, p, durable=False)  # no target yet: a plain rename
    assert rec.flags == []
    tdz_numba.save({"w": torch.ones(10)}, p, durable=False)
    assert rec.flags == [2]  # RENAME_EXCHANGE, once
    tdz_numba.save({"w": torch.full((10,), 2.0)}, p, durable=True)
    assert rec.flags == [2]  # durable: fsync, then os.replace (no swap)
    assert torch.equal(tdz_numba.load(p)["w"], torch.full((10,), 2.0))
    assert _names(tmp_path) == ["m.tdz"]


@pytest.mark.parametrize("result", [-1, None])
def test_without_the_swap_the_save_renames(tmp_path, monkeypatch, result):
    if result is None:  # no renameat2 in this C library
        real = libc.function
        monkeypatch.setattr(libc, "function", lambda name: None if name == "renameat2" else real(name))
    else:  # a file system that refuses RENAME_EXCHANGE (EINVAL)
        _Recorder(monkeypatch, result=result)
    p = tmp_path / "m.tdz"
    tdz_numba.save({"w": torch.zeros(10)}, p, durable=False)
    tdz_numba.save({"w": torch.ones(10)}, p, durable=False)
    assert torch.equal(tdz_numba.load(p)["w"], torch.ones(10))
    assert _names(tmp_path) == ["m.tdz"]


def test_the_old_file_is_closed_on_another_thread_after_the_rename(tmp_path, monkeypatch):
    released: list[int] = []
    monkeypatch.setattr(_tempfiles, "_release", released.append)
    target, tmp = tmp_path / "x.bin", tmp_path / "y.bin"
    target.write_bytes(b"old" * 1000)
    tmp.write_bytes(b"new")
    old_ino = target.stat().st_ino
    _tempfiles.replace(tmp, target)
    assert len(released) == 1
    st = os.fstat(released[0])  # the held descriptor: the old file, no name left
    try:
        assert (st.st_ino, st.st_nlink) == (old_ino, 0)
    finally:
        os.close(released[0])
    assert target.read_bytes() == b"new" and _names(tmp_path) == ["x.bin"]


def test_a_target_swapped_by_another_process_is_not_unlinked(tmp_path):
    target, tmp, other = tmp_path / "x.bin", tmp_path / "y.bin", tmp_path / "z.bin"
    target.write_bytes(b"old")
    tmp.write_bytes(b"new")
    held = _tempfiles._hold(target)
    assert held is not None
    try:
        other.write_bytes(b"someone else's")
        os.replace(other, target)  # target is no longer the held file
        assert _tempfiles._swapped(tmp, target, held) is False
    finally:
        os.close(held[0])
    assert target.read_bytes() == b"someone else's" and tmp.read_bytes() == b"new"  # swapped back


def test_links_and_shared_files_are_not_held(tmp_path):
    real = tmp_path / "real.bin"
    real.write_bytes(b"data")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    assert _tempfiles._hold(link) is None  # the link itself is replaced, never what it points to
    tmp = tmp_path / "new.bin"
    tmp.write_bytes(b"new")
    _tempfiles.replace(tmp, link, exchange=True)
    assert stat.S_ISREG(os.lstat(link).st_mode) and link.read_bytes() == b"new"
    assert real.read_bytes() == b"data"
    os.link(real, tmp_path / "second.bin")
    assert _tempfiles._hold(real) is None  # another name keeps it: nothing to free
    assert _tempfiles._hold(tmp_path / "missing.bin") is None
