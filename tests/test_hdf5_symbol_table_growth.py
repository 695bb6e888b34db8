"""An old-style group of more links than the symbol table's first capacity (4,096 rows): the
table grows and every link comes back, in h5py's order, each dataset mapped at h5py's offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tdz_numba.formats import hdf5_objects
from tdz_numba.formats.hdf5 import open_hdf5

h5py = pytest.importorskip("h5py")


def test_group_larger_than_the_first_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "many.h5"
    n = 4100
    with h5py.File(p, "w", libver="earliest") as f:  # symbol-table groups (v1 B-tree + local heap)
        for i in range(n):
            f.create_dataset(f"d{i}", data=np.full(2, i, np.int32))
    with h5py.File(p, "r") as f:
        order = list(f.keys())
        offsets = {k: f[k].id.get_offset() for k in order}
    caps: list[int] = []
    real = hdf5_objects.symbol_table
    monkeypatch.setattr(hdf5_objects, "symbol_table", lambda *a: caps.append(a[-1].shape[0]) or real(*a))
    src = open_hdf5(p)
    try:
        children = src.level("").children
        assert list(children) == order
        assert caps[0] == 1 << 12 and len(caps) >= 2 and caps[-1] >= n  # grew
        for k in (order[0], order[len(order) // 2], order[-1]):
            leaf = children[k].leaf
            assert leaf.offset == offsets[k] and leaf.shape == (2,) and leaf.loader is None
    finally:
        src.close()
