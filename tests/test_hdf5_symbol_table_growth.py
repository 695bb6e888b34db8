"""An old-style group of more links than the symbol table's first capacity (4,096 rows): its
local heap sizes the table, so one B-tree walk lists it; a table still too small (a heap of odd
names) grows; either way every link comes back, in h5py's order, each dataset mapped at h5py's
offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tdz_numba.formats import hdf5_objects
from tdz_numba.formats.hdf5 import open_hdf5

h5py = pytest.importorskip("h5py")


def _many(tmp_path: Path, n: int) -> tuple[Path, list[str], dict[str, int]]:
    p = tmp_path / "many.h5"
    with h5py.File(p, "w", libver="earliest") as f:  # symbol-table groups (v1 B-tree + local heap)
        for i in range(n):
            f.create_dataset(f"d{i}", data=np.full(2, i, np.int32))
    with h5py.File(p, "r") as f:
        order = list(f.keys())
        offsets = {k: f[k].id.get_offset() for k in order}
    return p, order, offsets


def _check(p: Path, order: list[str], offsets: dict[str, int]) -> None:
    src = open_hdf5(p)
    try:
        children = src.level("").children
        assert list(children) == order
        for k in (order[0], order[len(order) // 2], order[-1]):
            leaf = children[k].leaf
            assert leaf.offset == offsets[k] and leaf.shape == (2,) and leaf.loader is None
    finally:
        src.close()


def _caps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    caps: list[int] = []
    real = hdf5_objects.symbol_table
    monkeypatch.setattr(hdf5_objects, "symbol_table", lambda *a: caps.append(a[-1].shape[0]) or real(*a))
    return caps


def test_group_larger_than_the_first_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 4100
    p, order, offsets = _many(tmp_path, n)
    caps = _caps(monkeypatch)
    _check(p, order, offsets)
    assert len(caps) == 1 and n <= caps[0] < 4 * n  # the heap sized it: one walk


def test_table_too_small_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 300
    p, order, offsets = _many(tmp_path, n)
    caps = _caps(monkeypatch)
    monkeypatch.setattr(hdf5_objects, "first_capacity", lambda heap_len, bound: min(bound, 16))
    _check(p, order, offsets)
    assert caps == [16, 128, 1024]  # 8x per walk until every link fits


def test_first_capacity() -> None:
    assert hdf5_objects.first_capacity(0, 10) == 10
    assert hdf5_objects.first_capacity(0, 10**6) == hdf5_objects.FIRST_ROWS
    assert hdf5_objects.first_capacity(8 * 50_000, 10**6) == 50_001
