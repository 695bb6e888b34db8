"""The writer's units of work: large entries cut into pieces and small ones grouped, hashed
and written by several threads, must give the bytes of a serial write; errors in a
writing thread reach the caller and leave no temp file (issue 11, save)."""

from __future__ import annotations

import os
import threading
import time
import zipfile
import zlib

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba.zipfmt import packers
from tdz_numba.zipfmt import payload as payload_writer


@pytest.fixture
def fixed_time(monkeypatch):
    monkeypatch.setattr(packers, "dos_datetime", lambda timestamp=None: (0, 33))


def _tree():
    g = torch.Generator().manual_seed(3)
    sizes = [0, 1, 100, (1 << 18) - 1, 1 << 18, (1 << 18) + 1, 5, 1 << 20, 3]
    tree = {f"k{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    tree["many"] = {f"l{i}": torch.randn(i % 7 + 1, generator=g) for i in range(1200)}
    tree["text"] = "hello"
    tree["u8"] = np.arange(3 << 20, dtype=np.uint8)
    return tree


def test_plan_units_cover_every_entry_in_file_order():
    piece = payload_writer.SPAN
    stored = [10, 3 * piece, 0, 5, piece + 1, 7]
    split = [False, True, False, False, True, False]
    units = payload_writer.plan_units(split, stored)
    assert units[0] == (0, 1, -1)
    assert [u for u in units if u[0] == 1] == [(1, 0, piece), (1, piece, piece), (1, 2 * piece, piece)]
    assert (4, piece, 1) in units and units[-1] == (5, 6, -1)
    groups = [u for u in units if u[2] < 0]
    assert [(a, b) for a, b, _ in groups] == [(0, 1), (2, 4), (5, 6)]
    many = payload_writer.plan_units([False] * 1234, [1] * 1234)
    assert [b - a for a, b, _ in many] == [payload_writer.UNIT_ROWS, payload_writer.UNIT_ROWS, 234]


def test_plan_units_cut_spans_at_file_multiples_of_span():
    """Spans end at file offsets that are multiples of SPAN (so no 2 MiB piece of the file is
    written in two parts, which left the page cache with small folios: issue 27)."""
    span = payload_writer.SPAN
    stored = [10, 3 * span, 5, span + 1]
    offsets = [100, 1000, 1000 + 3 * span + 200, 2 * span - 64]
    units = payload_writer.plan_units([False, True, False, True], stored, offsets)
    spans1 = [u for u in units if u[0] == 1 and u[2] > 0]
    assert spans1 == [
        (1, 0, span - 1000),
        (1, span - 1000, span),
        (1, 2 * span - 1000, span),
        (1, 3 * span - 1000, 1000),
    ]
    assert [u for u in units if u[0] == 3 and u[2] > 0] == [(3, 0, 64), (3, 64, span - 63)]
    for i, off, length in (u for u in units if u[2] > 0 and u[0] in (1, 3)):
        end = offsets[i] + off + length
        assert (
            end % span == 0 or off + length == stored[i]
        )  # every span but an entry's last ends on a multiple
        assert sum(u[2] for u in units if u[0] == i and u[2] > 0) == stored[i]
    assert payload_writer.plan_units([False, True], [1, span], [0, span])[1:] == [
        (1, 0, span)
    ]  # aligned: one span


@pytest.mark.parametrize("kw", [{}, {"align": "auto", "align_threshold": 1000}, {"align": 65536}])
def test_threads_write_the_bytes_of_a_serial_save(fixed_time, tmp_path, kw):
    tree = _tree()
    serial = tdz_numba.save(tree, tmp_path / "serial.tdz", num_threads=1, **kw).read_bytes()
    for threads in (2, 3, 4):
        p = tdz_numba.save(tree, tmp_path / f"t{threads}.tdz", num_threads=threads, durable=False, **kw)
        assert p.read_bytes() == serial
    with zipfile.ZipFile(tmp_path / "serial.tdz") as z:
        assert z.testzip() is None  # every CRC-32 checked by the standard library
    out = tdz_numba.load(tmp_path / "t4.tdz")
    assert (
        torch.equal(out["k7"], tree["k7"]) and out["many"]["l1199"].tolist() == tree["many"]["l1199"].tolist()
    )


def test_entries_of_several_spans_have_the_crc_of_their_bytes(fixed_time, tmp_path):
    # large entries are written in SPAN units whose CRCs are combined: 1, 2 and 3 spans,
    # at payload offsets that are not multiples of PIECE (pieces cut at file offsets)
    span, piece = payload_writer.SPAN, payload_writer.PIECE
    rng = np.random.default_rng(5)
    tree = {
        "a": np.full(7, 120, np.uint8),
        "b": rng.integers(0, 256, span + 1, dtype=np.uint8),
        "c": rng.integers(0, 256, 2 * span + piece + 3, dtype=np.uint8),
        "d": rng.integers(0, 256, span, dtype=np.uint8),
    }
    serial = tdz_numba.save(tree, tmp_path / "s.tdz", num_threads=1, durable=False).read_bytes()
    p = tdz_numba.save(tree, tmp_path / "t.tdz", num_threads=3, durable=False)
    assert p.read_bytes() == serial
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
        for k in "bcd":
            info = z.getinfo(f"{k}.memmap")
            assert info.CRC == zlib.crc32(tree[k]) and z.read(info) == tree[k].tobytes()
    assert tdz_numba.verify(p).entries == 5  # raises on a CRC mismatch


def test_an_error_in_a_writing_thread_reaches_the_caller(tmp_path, monkeypatch):
    target = tmp_path / "x.tdz"
    tdz_numba.save({"old": torch.ones(3)}, target)
    before = target.read_bytes()
    real = os.pwrite
    failed = []

    def failing(fd, data, offset):  # the pieces of large entries: os.pwrite in the writing threads
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.05)  # the helper thread takes units meanwhile
        elif not failed:
            failed.append(offset)
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(tdz_numba.DiskFullError):
        tdz_numba.save({"w": torch.randn(8 << 20)}, target, num_threads=2)
    monkeypatch.undo()
    assert failed  # the error was raised in a helper thread, not in the caller's own writes
    assert target.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".tdz-tmp." in n]


def test_short_writes_of_the_serial_path_are_finished(fixed_time, tmp_path, monkeypatch):
    # the calling thread alone (the default): pieces written with os.pwrite; a short write
    # (the OS may write fewer bytes than asked) is finished, the bytes and CRCs unchanged
    span, piece = payload_writer.SPAN, payload_writer.PIECE
    rng = np.random.default_rng(9)
    tree = {"a": np.arange(5, dtype=np.uint8), "b": rng.integers(0, 256, span + piece + 17, dtype=np.uint8)}
    expected = tdz_numba.save(tree, tmp_path / "ok.tdz", durable=False).read_bytes()
    real = os.pwrite
    short = []

    def halves(fd, data, offset):
        view = memoryview(data).cast("B")
        if view.nbytes > 1:
            short.append(offset)
            view = view[: view.nbytes // 2]
        return real(fd, view, offset)

    monkeypatch.setattr(os, "pwrite", halves)
    p = tdz_numba.save(tree, tmp_path / "short.tdz", durable=False)
    monkeypatch.undo()
    assert short and p.read_bytes() == expected
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("b.memmap").CRC == zlib.crc32(tree["b"]) and z.testzip() is None


def test_an_error_in_the_serial_path_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "x.tdz"
    tdz_numba.save({"old": torch.ones(3)}, target)
    before = target.read_bytes()
    calls = []

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:  # mid-entry: after two pieces of the large leaf
            raise OSError(28, "No space left on device")
        return os.pwritev(fd, [data], offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(tdz_numba.DiskFullError):
        tdz_numba.save({"w": torch.randn(1 << 20)}, target)  # num_threads=None: the caller writes
    monkeypatch.undo()
    assert len(calls) == 3 and target.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".tdz-tmp." in n]
