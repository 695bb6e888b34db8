"""The shape and stride tuples of a scanned ``torch.save`` pickle, one pair of tuples per distinct
layout: a model's tensors share a few shapes (a Llama-shaped one: 146 tensors, a dozen), so the
tuples are made once each and shared, instead of two per tensor.

:func:`shape_ids` (compiled) gives each row of the scan the first row with the same rank, sizes
and strides (an open-addressing table over the values, every match compared in full);
:func:`shared_shapes` makes the distinct rows' tuples and hands each row its representative's.
The tuples equal what reading each row one by one makes (that loop is the oracle in the
tests); rows whose sizes or strides do not lie inside ``dims`` return None. :func:`scan_shapes`
is what :mod:`.pickle_scan` calls: a block of one rank laid out row after row is cut with numpy,
other layouts of many rows go through :func:`shared_shapes`, and a few rows (or rows it
declines) are read one by one.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.formats.pickle_shapes import shared_shapes
>>> dims = np.array([2, 3, 3, 1, 4, 1, 2, 3, 3, 1], np.int64)  # (2, 3)/(3, 1), (4,)/(1,), (2, 3)/(3, 1)
>>> shapes, strides = shared_shapes(dims, np.array([2, 1, 2]), np.array([0, 4, 6]), np.array([2, 5, 8]))
>>> shapes, strides, shapes[0] is shapes[2]
([(2, 3), (4,), (2, 3)], [(3, 1), (1,), (3, 1)], True)
"""

from __future__ import annotations

from operator import add

import numpy as np
from numba import njit

from ..jit.presets import BORROWED

__all__ = ["shape_ids", "shared_shapes", "scan_shapes", "FEW"]


@njit(**BORROWED)
def shape_ids(dims, ndim, shape_at, stride_at, ids, table):  # pragma: no cover - compiled
    """Fills ``ids[i]``: the first row ``j <= i`` whose rank, sizes (``dims[shape_at[j]:][:ndim[j]]``)
    and strides (``dims[stride_at[j]:][:ndim[j]]``) equal row ``i``'s. ``table`` (a power of two
    of slots, at least twice the rows, all -1) is the scratch. 0, or 1 when a row's values do not
    lie inside ``dims`` or the table is too small (``ids`` then means nothing)."""
    n = ndim.size
    size = table.size
    if size < 2 * n or size & (size - 1) or shape_at.size != n or stride_at.size != n or ids.size != n:
        return 1
    total = dims.size
    mask = size - 1
    for i in range(n):
        d, a, b = ndim[i], shape_at[i], stride_at[i]
        if d < 0 or a < 0 or b < 0 or a > total - d or b > total - d:
            return 1
        h = np.uint64(d) * np.uint64(0x9E3779B97F4A7C15)
        for k in range(d):
            h = (h ^ np.uint64(dims[a + k])) * np.uint64(0x100000001B3)
            h = (h ^ np.uint64(dims[b + k])) * np.uint64(0x100000001B3)
        slot = np.int64(h >> np.uint64(17)) & mask
        while True:
            j = table[slot]
            if j < 0:
                table[slot] = i
                ids[i] = i
                break
            same = ndim[j] == d
            if same:
                aj, bj = shape_at[j], stride_at[j]
                for k in range(d):
                    if dims[aj + k] != dims[a + k] or dims[bj + k] != dims[b + k]:
                        same = False
                        break
            if same:
                ids[i] = j
                break
            slot = (slot + 1) & mask
    return 0


def shared_shapes(
    dims: np.ndarray, ndim: np.ndarray, shape_at: np.ndarray, stride_at: np.ndarray
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]] | None:
    """Each row's shape and stride tuples (rows of one layout share the same two tuple objects),
    or None where :func:`shape_ids` declines (a row outside ``dims``)."""
    n = len(ndim)
    nd = np.ascontiguousarray(ndim, np.int64)
    at = np.ascontiguousarray(shape_at, np.int64)
    st = np.ascontiguousarray(stride_at, np.int64)
    ids = np.empty(n, np.int64)
    table = np.full(max(2, 1 << (2 * n - 1).bit_length()), -1, np.int64)
    if n == 0 or shape_ids(np.ascontiguousarray(dims, np.int64), nd, at, st, ids, table):
        return None
    firsts = np.flatnonzero(ids == np.arange(n))
    shape_of, stride_of = {}, {}
    many = 8 * len(firsts) > n  # (few layouts: each one's values read alone, not all of dims)
    flat = dims[: int((st + nd).max())].tolist() if many else dims
    for i, d, a, b in zip(firsts.tolist(), nd[firsts].tolist(), at[firsts].tolist(), st[firsts].tolist()):
        if many:
            shape_of[i], stride_of[i] = tuple(flat[a : a + d]), tuple(flat[b : b + d])
        else:
            shape_of[i], stride_of[i] = tuple(flat[a : a + d].tolist()), tuple(flat[b : b + d].tolist())
    rows = ids.tolist()
    return list(map(shape_of.__getitem__, rows)), list(map(stride_of.__getitem__, rows))


#: Up to this many tensors, :func:`scan_shapes` looks for no block of one rank and no shared
#: layouts (their numpy calls cost about what a few dozen tuples do).
FEW = 64


def scan_shapes(dims: np.ndarray, cols: np.ndarray) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Each row's shape and stride tuples: ``cols`` holds each row's rank and where its sizes and
    its strides start in ``dims`` (three int64 columns, as :mod:`.pickle_scan` lays them out).

    >>> dims = np.array([2, 3, 3, 1, 4, 1], np.int64)
    >>> scan_shapes(dims, np.array([[2, 0, 2], [1, 4, 5]]))
    ([(2, 3), (4,)], [(3, 1), (1,)])
    """
    count = len(cols)
    if count > FEW:
        ndim, at, st = cols[:, 0], cols[:, 1], cols[:, 2]
        k = int(ndim[0])
        if k and (ndim == k).all() and (st == at + k).all() and (np.diff(at) == 2 * k).all():
            first = int(at[0])  # one rank, in a row
            block = dims[first : first + 2 * k * count].reshape(count, 2, k)
            return _rows(block[:, 0]), _rows(block[:, 1])
        shared = shared_shapes(dims, ndim, at, st)  # two tuples per distinct layout, not per row
        if shared is not None:
            return shared
    nds, ats, sts = cols.T.tolist()  # (the three columns at once)
    end = max(map(add, sts, nds)) if count <= FEW else int((cols[:, 2] + cols[:, 0]).max())
    flat = dims[:end].tolist()
    sizes, strides = [], []
    for a, b, d in zip(ats, sts, nds):
        sizes.append(tuple(flat[a : a + d]))
        strides.append(tuple(flat[b : b + d]))
    return sizes, strides


def _rows(block: np.ndarray) -> list[tuple[int, ...]]:
    """Each row of a 2-D int array as a tuple; one tuple object shared by all when the rows are
    equal (a model's many equal layers: no tuple made per row)."""
    if (block == block[0]).all():
        return [tuple(block[0].tolist())] * len(block)
    return list(map(tuple, block.tolist()))
