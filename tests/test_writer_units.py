"""The writer's units of work: large entries cut into pieces and small ones grouped, hashed
and written by several threads, must give the bytes of a serial write; errors in a
writing thread reach the caller and leave no temp file (issue 11, save)."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest
import torch

import tdz_numba
from tdz_numba import payload_writer, records


@pytest.fixture
def fixed_time(monkeypatch):
    monkeypatch.setattr(records, "dos_datetime", lambda timestamp=None: (0, 33))


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


def test_an_error_in_a_writing_thread_reaches_the_caller(tmp_path, monkeypatch):
    target = tmp_path / "x.tdz"
    tdz_numba.save({"old": torch.ones(3)}, target)
    before = target.read_bytes()
    real = os.pwritev
    calls = []

    def failing(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(tdz_numba.DiskFullError):
        tdz_numba.save({"w": torch.randn(4 << 20)}, target, num_threads=2)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".tdz-tmp." in n]
