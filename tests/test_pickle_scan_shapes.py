"""pickle_shapes.scan_shapes (every row's shape and stride tuples) against the obvious loop, on the
layouts the scan writes: one rank in a row, mixed ranks, rank 0, few rows and many."""

from __future__ import annotations

import numpy as np
import pytest

from tdz_numba.formats import pickle_scan as ps
from tdz_numba.formats.pickle_shapes import FEW, scan_shapes


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


@pytest.mark.parametrize("count", [1, 2, FEW, FEW + 1, 300])
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
    got = scan_shapes(dims, cols[:, ps._NDIM : ps._STRIDE_AT + 1])
    assert got == _oracle(dims, cols)
    assert all(type(t) is tuple and all(type(x) is int for x in t) for part in got for t in part)


def _ids_oracle(dims, ndim, at, st):
    """The first row of each row's layout, by the obvious dict of tuples."""
    flat, first, out = dims.tolist(), {}, []
    for i, (d, a, b) in enumerate(zip(ndim.tolist(), at.tolist(), st.tolist())):
        out.append(first.setdefault((d, tuple(flat[a : a + d]), tuple(flat[b : b + d])), i))
    return out


@pytest.mark.parametrize("count", [1, 2, 65, 5000])
@pytest.mark.parametrize("distinct", [1, 7, None])  # None: nearly every row its own layout
def test_shape_ids_match_a_dict(count, distinct):
    from tdz_numba.formats.pickle_shapes import shape_ids, shared_shapes

    rng = np.random.default_rng(count)
    pool = [rng.integers(-3, 1 << 40, rng.integers(0, 5)).tolist() for _ in range(distinct or count)]
    ranks, dims = [], []
    for _ in range(count):
        sizes = pool[rng.integers(0, len(pool))]
        ranks.append(len(sizes))
        dims += sizes + [x * 3 + 1 for x in sizes]  # sizes, then strides
    dims_a = np.array(dims + [0], np.int64)
    ndim = np.array(ranks, np.int64)
    at = np.concatenate(([0], np.cumsum(2 * ndim)[:-1])).astype(np.int64)
    st = at + ndim
    ids = np.empty(count, np.int64)
    table = np.full(1 << (2 * count - 1).bit_length(), -1, np.int64)
    assert shape_ids(dims_a, ndim, at, st, ids, table) == 0
    assert ids.tolist() == _ids_oracle(dims_a, ndim, at, st)
    shapes, strides = shared_shapes(dims_a, ndim, at, st)
    flat = dims_a.tolist()
    assert shapes == [tuple(flat[a : a + d]) for a, d in zip(at.tolist(), ranks)]
    assert strides == [tuple(flat[b : b + d]) for b, d in zip(st.tolist(), ranks)]
    for i, j in enumerate(ids.tolist()):  # one tuple object per layout
        assert shapes[i] is shapes[j] and strides[i] is strides[j]


def test_shape_ids_decline_rows_outside_dims_and_small_tables():
    from tdz_numba.formats.pickle_shapes import shape_ids, shared_shapes

    dims = np.arange(10, dtype=np.int64)
    ok = (np.array([2, 2], np.int64), np.array([0, 4], np.int64), np.array([2, 6], np.int64))
    ids, table = np.empty(2, np.int64), np.full(4, -1, np.int64)
    assert shape_ids(dims, *ok, ids, table) == 0 and ids.tolist() == [0, 1]
    for nd, a, b in (([2, 2], [0, 9], [2, 6]), ([2, -1], [0, 4], [2, 6]), ([2, 2], [0, 4], [2, -2])):
        bad = tuple(np.array(x, np.int64) for x in (nd, a, b))
        assert shape_ids(dims, *bad, np.empty(2, np.int64), np.full(4, -1, np.int64)) == 1
        assert shared_shapes(dims, *bad) is None
    assert shape_ids(dims, *ok, np.empty(2, np.int64), np.full(2, -1, np.int64)) == 1  # too small
    assert shape_ids(dims, *ok, np.empty(2, np.int64), np.full(6, -1, np.int64)) == 1  # not 2**k
    assert shared_shapes(dims, *(np.zeros(0, np.int64),) * 3) is None
