"""A cold load's far local headers go to the disk together (issue 27): ``files.pagecache.read_pieces``
starts every miss's read (its ``RWF_NOWAIT`` pass) before it waits for any, rather than one disk
round trip per header (146 of them for a Llama-shaped ``.tdz``: 1.0 s of a cold load's time with
another process reading the disk, against 11 ms now)."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.bench.harness import drop_cache
from tdz_numba.files import pagecache

PAGE = mmap.PAGESIZE
NOWAIT = getattr(os, "RWF_NOWAIT", None)
pytestmark = pytest.mark.skipif(NOWAIT is None, reason="no RWF_NOWAIT on this platform")


def _cold_or_skip(path) -> None:
    drop_cache(Path(path))
    if pagecache.cached(path, 0, os.path.getsize(path)).any():
        pytest.skip("this file system keeps the file's pages cached (tmpfs): no cold reads here")


def _recording(monkeypatch, path, pieces):
    """``os.preadv`` that records ``(kind, offset)`` per call, and at the first plain (blocking)
    read, which of ``pieces``' first pages reach the page cache without another read (their
    reads were started by then)."""
    real = os.preadv
    calls: list[tuple[str, int]] = []
    seen: dict[str, list[bool]] = {}

    def preadv(fd, bufs, offset, *flags):
        nowait = bool(flags and flags[0] & NOWAIT)
        if not nowait and "at_first_wait" not in seen:  # (mincore reads nothing: it only looks)
            deadline = time.monotonic() + 5
            while True:  # a started read completes on its own; one never started does not
                now = [bool(pagecache.cached(path, o, 1)[0]) for o in pieces]
                if all(now) or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            seen["at_first_wait"] = now
        calls.append(("nowait" if nowait else "wait", offset))
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls, seen


def _recording_drops(monkeypatch) -> list[tuple[int, int]]:
    """``os.posix_fadvise`` that records the ``[first, stop)`` pages of every ``DONTNEED``."""
    real = os.posix_fadvise
    dropped: list[tuple[int, int]] = []

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append((offset // PAGE, -(-(offset + length) // PAGE)))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return dropped


def test_misses_are_started_together_before_any_wait(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * PAGE))
    _cold_or_skip(path)
    offsets, sizes = [40 * PAGE + 7, 3 * PAGE + 100, 20 * PAGE, 60 * PAGE - 5], [30, 50, 8, 20]
    calls, seen = _recording(monkeypatch, path, [o // PAGE * PAGE for o in offsets])
    dropped = _recording_drops(monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = pagecache.read_pieces(fd, offsets, sizes)
    finally:
        os.close(fd)
    monkeypatch.undo()
    # the pages the misses brought in are handed back (POSIX_FADV_DONTNEED on each miss's pages;
    # whether the kernel then drops them at once is its own affair: test_pagecache checks the
    # residency where nothing else is in flight)
    waited = {o for k, o in calls if k == "wait"}  # (a miss's rest is read from its first missing byte)
    missed = [(o, n) for o, n in zip(offsets, sizes) if any(o <= w < o + n for w in waited)]
    asked = {p for off, n in missed for p in range(off // PAGE, -(-(off + n) // PAGE))}
    if missed:  # exactly the misses' pages are handed back
        assert asked <= {p for first, stop in dropped for p in range(first, stop)}
    else:  # the device answered every RWF_NOWAIT read within the call (its read-ahead already done,
        # seen in CI under load): nothing missed, so nothing is handed back
        assert not dropped
    with open(path, "rb") as f:
        data = f.read()
    assert bytes(got) == b"".join(data[o : o + n] for o, n in zip(offsets, sizes))
    kinds = [k for k, _ in calls]
    # every piece asked without waiting first, in the caller's order; only then the waits
    assert kinds[: len(offsets)] == ["nowait"] * len(offsets)
    assert [o for _, o in calls[: len(offsets)]] == offsets
    assert set(kinds[len(offsets) :]) <= {"wait"}
    if kinds.count("wait"):  # every miss's read was in flight (or done) before the first wait
        assert all(seen["at_first_wait"])


def test_cold_load_reads_far_headers_in_one_batch(tmp_path, monkeypatch):
    tree = {f"w{i:02d}": torch.full((24 * 1024,), float(i)) for i in range(12)}  # 96 KiB apart
    path = tdz_numba.save(tree, tmp_path / "m.tdz", durable=False)
    _cold_or_skip(path)
    calls, _ = _recording(monkeypatch, path, [])
    back = tdz_numba.load(path)
    monkeypatch.undo()
    header_calls = [k for k, _ in calls]
    entries = len(tree) + 1  # a payload per leaf and the root's meta.json
    assert header_calls.count("nowait") == entries  # one per far local header
    first_wait = header_calls.index("wait") if "wait" in header_calls else len(header_calls)
    assert first_wait == entries  # no header waited for before every header's read had started
    assert all(torch.equal(back[k], v) for k, v in tree.items())
    np.testing.assert_array_equal(back["w11"].numpy(), np.full(24 * 1024, 11.0, np.float32))
