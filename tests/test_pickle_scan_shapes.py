"""pickle_scan._shapes (every row's shape and stride tuples) against the obvious loop, on the
layouts the scan writes: one rank in a row, mixed ranks, rank 0, few rows and many."""

from __future__ import annotations

import numpy as np
import pytest

from tdz_numba.formats import pickle_scan as ps


def _oracle(dims, cols):
    flat = dims.tolist()
    out = []
    for row in cols.tolist():
        d, a, b = row[ps._NDIM], row[ps._SHAPE_AT], row[ps._STRIDE_AT]
        out.append((tuple(flat[a : a + d]), tuple(flat[b : b + d])))
    return [s for s, _ in out], [t for _, t in out]


def _layout(ranks, rng, gap=False, same=False):
    """The scan's layout: each row's shape then its strides in ``dims`` (a gap between rows where
    ``gap``: a memo get copied elsewhere)."""
    dims, rows = [], []
    for k in ranks:
        if gap:
            dims.append(-7)
        shape = [3] * k if same else rng.integers(0, 9, k).tolist()
        at = len(dims)
        dims += shape
        st = len(dims)
        dims += rng.integers(0, 50, k).tolist()
        row = [0] * ps.NCOL
        row[ps._NDIM], row[ps._SHAPE_AT], row[ps._STRIDE_AT] = k, at, st
        rows.append(row)
    return np.array(dims + [0] * 8, np.int64), np.array(rows, np.int64).reshape(len(ranks), ps.NCOL)


@pytest.mark.parametrize("count", [1, 2, ps._FEW, ps._FEW + 1, 300])
@pytest.mark.parametrize("kind", ["one rank", "one rank, equal rows", "mixed", "with rank 0", "gaps"])
def test_shapes_match_the_loop(count, kind):
    rng = np.random.default_rng(count)
    if kind.startswith("one rank"):
        ranks = [2] * count
    elif kind == "mixed":
        ranks = rng.integers(1, 4, count).tolist()
    else:
        ranks = rng.integers(0, 3, count).tolist()
    dims, cols = _layout(ranks, rng, gap=kind == "gaps", same=kind.endswith("equal rows"))
    dims.flags.writeable = False
    got = ps._shapes(dims, cols)
    assert got == _oracle(dims, cols)
    assert all(type(t) is tuple and all(type(x) is int for x in t) for part in got for t in part)
