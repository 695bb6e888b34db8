"""zipfmt.headreads.read_pieces: the same bytes, the same calls and the same page-cache residency
as files.pagecache.read_pieces (its oracle), on cached and cold files, short reads past the end,
partly cached pieces, files that refuse RWF_NOWAIT or advice."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import tdz_numba
from tdz_numba.bench.harness import drop_cache
from tdz_numba.files import pagecache
from tdz_numba.zipfmt import headreads

PAGE = mmap.PAGESIZE
NOWAIT = getattr(os, "RWF_NOWAIT", None)


def _oracle(path, offsets, sizes) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return b"".join(os.pread(fd, n, o).ljust(n, b"\0") for o, n in zip(offsets, sizes))
    finally:
        os.close(fd)


def _read(fn, path, offsets, sizes) -> bytearray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fn(fd, offsets, sizes)
    finally:
        os.close(fd)


def _cold_or_skip(path) -> None:
    drop_cache(Path(path))
    try:
        left = pagecache.cached(path, 0, os.path.getsize(path))
    except tdz_numba.TdzError as exc:  # pragma: no cover - a platform without mincore
        pytest.skip(f"no page-cache residency here: {exc}")
    if left.any():
        pytest.skip("this file system keeps the file's pages cached (tmpfs): no cold reads here")


def _file(tmp_path, size):
    rng = np.random.default_rng(size)
    path = tmp_path / "f.bin"
    path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


@pytest.mark.parametrize("cold", [False, True])
def test_same_bytes_as_pagecache(tmp_path, cold):
    size = 9 * PAGE + 123
    path = _file(tmp_path, size)
    # pieces of 1 byte, crossing pages, ending at / past / beyond the end, out of order, repeated
    offsets = [0, 1, PAGE - 2, 3 * PAGE, size - 5, size - 1, size, size + 10, 7, 2 * PAGE + 5, 0]
    sizes = [1, 30, 30, PAGE + 7, 5, 40, 3, 8, 2, 2 * PAGE, 1]
    want = _oracle(path, offsets, sizes)
    if cold:
        _cold_or_skip(path)
    got = _read(headreads.read_pieces, path, offsets, sizes)
    assert type(got) is bytearray and bytes(got) == want
    assert bytes(_read(pagecache.read_pieces, path, offsets, sizes)) == want
    assert _read(headreads.read_pieces, path, [], []) == bytearray()
    assert bytes(_read(headreads.read_pieces, path, [5, 6], [0, 3])) == _oracle(
        path, [6], [3]
    )  # (a piece of no bytes)


@pytest.mark.skipif(NOWAIT is None, reason="no RWF_NOWAIT on this platform")
def test_same_calls_and_residency_as_pagecache(tmp_path, monkeypatch):
    """Every piece asked with RWF_NOWAIT first, in order, then the misses waited for; the pages the
    misses brought in are dropped again, a page cached before is kept."""
    path = _file(tmp_path, 32 * PAGE)
    offsets = [2 * PAGE + 100, 9 * PAGE + 40, 4 * PAGE - 10, 20 * PAGE, 9 * PAGE + 50, 31 * PAGE + 4000]
    sizes = [50, 30, 20, 60, 10, 500]  # (4 * PAGE - 10: two pages; the last past the end)
    real = os.preadv
    seen: list[list[tuple[bool, int]]] = []

    def preadv(fd, bufs, offset, *flags):
        seen[-1].append((bool(flags and flags[0] & (NOWAIT or 0)), offset))
        return real(fd, bufs, offset, *flags)

    residency = []
    for fn in (pagecache.read_pieces, headreads.read_pieces):
        _cold_or_skip(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, 10, 9 * PAGE + 5)  # page 9 cached before
            before = pagecache.cached(path, 0, 32 * PAGE)
            seen.append([])
            monkeypatch.setattr(os, "preadv", preadv)
            got = fn(fd, offsets, sizes)
            monkeypatch.undo()
        finally:
            os.close(fd)
        residency.append((before, pagecache.cached(path, 0, 32 * PAGE)))
        assert bytes(got) == _oracle(path, offsets, sizes)
    assert seen[0] == seen[1]
    assert [o for w, o in seen[1] if w] == offsets  # every piece without waiting first, in order
    for before, after in residency:
        np.testing.assert_array_equal(after, before)


def test_where_the_file_refuses_nowait(tmp_path, monkeypatch):
    path = _file(tmp_path, 3 * PAGE)
    real = os.preadv
    calls = []

    def refusing(fd, bufs, off, *flags):
        calls.append(flags)
        if flags and flags[0]:
            raise OSError(errno.EOPNOTSUPP, "no RWF_NOWAIT here")
        return real(fd, bufs, off)

    monkeypatch.setattr(pagecache, "_NOWAIT_REFUSED", [])
    monkeypatch.setattr(os, "preadv", refusing)
    offsets, sizes = [10, PAGE - 3, 2 * PAGE], [5, 9, PAGE]
    assert bytes(_read(headreads.read_pieces, path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert bytes(_read(headreads.read_pieces, path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert sum(1 for f in calls if f and f[0]) == 1  # asked once, then plain reads
    assert pagecache._NOWAIT_REFUSED == [True]


def test_refused_after_a_miss_drops_only_the_misses_before(tmp_path, monkeypatch):
    """A file that answers EAGAIN for the first piece and refuses the flag at the second: the first
    is read and its pages dropped (as pagecache.read_pieces does), the rest read plainly."""
    path = _file(tmp_path, 8 * PAGE)
    real = os.preadv
    state = {"n": 0}

    def flaky(fd, bufs, off, *flags):
        if flags and flags[0]:
            state["n"] += 1
            raise (BlockingIOError() if state["n"] == 1 else OSError(errno.EINVAL, "no RWF_NOWAIT"))
        return real(fd, bufs, off)

    drops = []
    real_drop = pagecache.drop_pages
    monkeypatch.setattr(pagecache, "_NOWAIT_REFUSED", [])
    monkeypatch.setattr(os, "preadv", flaky)
    monkeypatch.setattr(
        pagecache, "drop_pages", lambda fd, pages: drops.append(list(pages)) or real_drop(fd, pages)
    )
    offsets, sizes = [PAGE + 10, 5 * PAGE, 6 * PAGE + 1], [20, 30, 40]
    assert bytes(_read(headreads.read_pieces, path, offsets, sizes)) == _oracle(path, offsets, sizes)
    assert drops == [[(1, 2)]]


def test_where_the_file_takes_no_advice(tmp_path, monkeypatch):
    path = _file(tmp_path, 3 * PAGE)

    def refusing(fd, offset, length, advice):
        raise OSError(errno.EINVAL, "no advice here")

    monkeypatch.setattr(os, "posix_fadvise", refusing)
    offsets, sizes = [10, PAGE - 3, 2 * PAGE], [5, 9, PAGE]
    assert bytes(_read(headreads.read_pieces, path, offsets, sizes)) == _oracle(path, offsets, sizes)
