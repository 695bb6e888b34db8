"""Many leaves of one mapping made as tensors a run at a time, and the C-contiguous strides of shapes.

:func:`_made_in_runs` (and :func:`_made_split`) make the leaves that
:func:`~tdz_numba.tdz.specbulk.views_and_extents` and the plain-level reader
(:mod:`~tdz_numba.tdz.plainlevel`) have already checked: runs of evenly spaced leaves of one
shape by one ``as_strided`` and an ``unbind`` (or ``split_with_sizes``), 1-D leaves with gaps
between them by one ``split_with_sizes`` over their span, each leaf its own tensor with its
own version counter (the callers hold :func:`~tdz_numba.tdz.sources.own_views`).

Examples
--------
>>> _contiguous_of([(2, 3, 4), (5,), ()])
[(12, 4, 1), (1,), ()]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__: list[str] = []  # the wing's own helpers (tdz/specbulk.py, tdz/plainlevel.py)


def _contiguous_of(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """C-contiguous element strides of each shape (computed once per distinct shape)."""
    table: dict[tuple[int, ...], tuple[int, ...]] = {}
    for shape in set(shapes):
        out = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            out[i] = out[i + 1] * max(shape[i + 1], 1)
        table[shape] = tuple(out)
    return list(map(table.__getitem__, shapes))


#: Fewest leaves in a run made by one ``unbind`` (:func:`_made_in_runs`).
_RUN = 8
#: Fewest leaves for which runs are looked for: below it the search (a dozen numpy calls, ~0.1 ms)
#: costs about what runs save when found, and all of it when not (a Llama-shaped model's 146
#: leaves of a dozen shapes: no runs; 0.1-0.25 ms of a 2 ms load, measured on a loaded machine).
_RUNS_FROM = 256


def _made_in_runs(
    table: list[Any], tidx: np.ndarray, shapes: Sequence[Any], strides: Sequence[Any], elem: np.ndarray
) -> list[Any] | None:
    """The leaves as :func:`spec_views` makes them, runs of them made at once: leaves of one
    typed view, one shape and one strides (taken in order within that group: the leaves of an
    ``.npz`` alternate between two byte shifts) whose element offsets step by a constant
    ``d >= 0`` are ``as_strided((m, *shape), (d, *strides), first).unbind(0)``, made below
    autograd's view tracking: each its own tensor with its own version counter, at about half
    the cost of one ``as_strided`` each. None when runs of :data:`_RUN` or more leaves would
    not cover half of them (unless :func:`_made_split` makes them)."""
    m, given = elem.size, elem
    if len(set(shapes)) == 1 and len(set(strides)) == 1:  # C-level hashing: the common case
        group = tidx
    else:
        ids: dict[tuple[Any, Any], int] = {}
        for pair in zip(shapes, strides):
            if pair not in ids:
                ids[pair] = len(ids)
                if len(ids) > m // _RUN:
                    return None
        group = tidx * len(ids) + np.fromiter(map(ids.__getitem__, zip(shapes, strides)), np.int64, m)
    order = None
    if (np.diff(group) < 0).any() or (group[1:] != group[:-1]).sum() > m // _RUN:
        order = np.argsort(group, kind="stable")
        group, elem = group[order], elem[order]
    d = np.diff(elem)
    start = np.ones(m, bool)
    start[1:] = (group[1:] != group[:-1]) | (d < 0)
    start[2:] |= d[1:] != d[:-1]
    bounds = np.flatnonzero(start).tolist() + [m]
    sizes = np.diff(bounds)
    if 2 * int(sizes[sizes >= _RUN].sum()) < m:
        return _made_split(table, tidx, shapes, strides, given)
    pick = order.tolist() if order is not None else None
    made: list[Any] = []
    view = _AS_STRIDED()
    first = elem.tolist()
    tids = tidx[order].tolist() if order is not None else tidx.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        typed = table[tids[a]]
        if pick is None:
            shape, st, sh, sts = shapes[a], strides[a], shapes[a:b], strides[a:b]
        else:
            shape, st = shapes[pick[a]], strides[pick[a]]
            sh, sts = [shapes[i] for i in pick[a:b]], [strides[i] for i in pick[a:b]]
        if b - a >= _RUN:
            step = first[a + 1] - first[a]
            if shape and step == math.prod(shape) and st == _contiguous_of([shape])[0]:
                # packed C-contiguous leaves: one block split along its first dimension (cheaper
                # than unbind: no select per leaf), the same storage, offsets, shapes and strides
                rows = (b - a) * shape[0]
                made.extend(
                    view(typed, (rows, *shape[1:]), st, first[a]).split_with_sizes([shape[0]] * (b - a))
                )
            else:
                made.extend(view(typed, (b - a, *shape), (step, *st), first[a]).unbind(0))
        else:
            made.extend(map(view, [typed] * (b - a), sh, sts, first[a:b]))
    if order is None:
        return made
    back = np.empty(m, np.int64)
    back[order] = np.arange(m)
    return list(map(made.__getitem__, back.tolist()))


def _made_split(
    table: list[Any], tidx: np.ndarray, shapes: Sequence[Any], strides: Sequence[Any], elem: np.ndarray
) -> list[Any] | None:
    """The leaves as :func:`spec_views` makes them when they are 1-D and contiguous but not evenly
    spaced (an HDF5 file's data blocks: steps of 10 and 12 KiB alternate): per typed view, in
    element order, one 1-D ``as_strided`` over their span split by ``split_with_sizes`` into the
    leaves and the gaps between them (a gap of no elements takes no piece), the leaves' pieces
    kept: each its own tensor with its own version counter, at the leaves' offsets, about half the
    cost of one ``as_strided`` each while the gaps' pieces stay under half the leaves'. None when
    the leaves are not all 1-D with strides ``(1,)``, two of one typed view overlap, or there are
    too many gaps; the span covers only bytes between checked leaves."""
    m = elem.size
    if set(map(len, shapes)) != {1} or set(strides) != {(1,)}:
        return None
    lens = np.full(m, shapes[0][0], np.int64) if len(set(shapes)) == 1 else np.array(shapes, np.int64)[:, 0]
    if (tidx == tidx[0]).all():
        order = None if (np.diff(elem) >= 0).all() else np.argsort(elem, kind="stable")
    else:
        order = np.lexsort((elem, tidx))
    if order is not None:
        tidx, elem, lens = tidx[order], elem[order], lens[order]
    gaps = elem[1:] - (elem[:-1] + lens[:-1])
    same = tidx[1:] == tidx[:-1]
    if (gaps[same] < 0).any():
        return None  # overlapping leaves: one as_strided each
    cut = ~same | (gaps > 0)  # after leaf i a piece (a gap) or a new span
    if 3 * int(cut.sum()) > m:
        return None  # more gap pieces than a third of the leaves: no cheaper than one each
    view = _AS_STRIDED()
    bounds = np.flatnonzero(~same).tolist()
    made: list[Any] = []
    first, last, tids = elem.tolist(), (elem + lens).tolist(), tidx.tolist()
    for a, b in zip([0, *[x + 1 for x in bounds]], [*[x + 1 for x in bounds], m]):
        g = gaps[a : b - 1]
        has = g > 0
        pos = np.arange(b - a) + np.concatenate(([0], np.cumsum(has)))
        sizes = np.zeros(int(pos[-1]) + 1, np.int64)
        sizes[pos] = lens[a:b]
        sizes[pos[:-1][has] + 1] = g[has]
        pieces = view(table[tids[a]], (last[b - 1] - first[a],), (1,), first[a]).split_with_sizes(
            sizes.tolist()
        )
        made.extend(pieces if b - a == len(pieces) else map(pieces.__getitem__, pos.tolist()))
    if order is None:
        return made
    back = np.empty(m, np.int64)
    back[order] = np.arange(m)
    return list(map(made.__getitem__, back.tolist()))


def _AS_STRIDED() -> Any:
    import torch

    return torch.Tensor.as_strided
