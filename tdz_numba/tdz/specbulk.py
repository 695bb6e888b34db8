"""Many :class:`~tdz_numba.tdz.sources.TensorSpec` leaves turned into tensors at once.

:func:`spec_views` is the bulk form of :func:`~tdz_numba.tdz.sources.tensor_from_spec`
for the leaves every foreign reader emits most (STORED, no loader): the specs'
fields are taken apart column by column (``zip(*specs)``), every bound is checked
once over numpy arrays of offsets, sizes and spans (per file), and each leaf is one
``as_strided`` on a typed view of its file's mapping (:meth:`MappedFile.typed`, one
per dtype and byte shift, so an unaligned leaf is a view too), made below
autograd's view tracking (:func:`~tdz_numba.tdz.sources.own_views`): each leaf is its
own tensor with its own version counter, as the ``.tdz`` reader's
:meth:`~tdz_numba.tdz.source.TdzSource.tensors` makes them. The tensors are the ones
:func:`~tdz_numba.tdz.sources.tensor_from_spec` makes (same storage, offset, shape and
strides). A spec the fast path does not take (a loader, a codec, a bound that does
not hold, a malformed shape) comes back as None: the caller makes it one by one with
:func:`~tdz_numba.tdz.sources.tensor_from_spec`, which raises the reader's error (file,
key, what is wrong) exactly as before.

Examples
--------
>>> import tempfile, pathlib, numpy as np, torch
>>> from tdz_numba.tdz.sources import MappedFile, TensorSpec
>>> from tdz_numba.tdz.specbulk import spec_views
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "raw.bin"
...     _ = p.write_bytes(b"\\0" + np.arange(6, dtype=np.float32).tobytes())
...     f = MappedFile.open(p)
...     specs = [TensorSpec("a", torch.float32, (2,), None, 0, 1, 8),     # offset 1: unaligned
...              TensorSpec("b", torch.float32, (9,), None, 0, 1, 36)]    # past the end: None
...     a, b = spec_views(specs, [f])
...     print(a.tolist(), b, a.data_ptr() - f.buffer.ctypes.data)
[0.0, 1.0] None 1
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from operator import is_ as _is
from typing import Any, NamedTuple

import numpy as np

from . import sources as _sources
from .sources import MappedFile, TensorSpec, leaf_view, needs_alignment, own_views
from .viewruns import _AS_STRIDED, _RUN, _RUNS_FROM, _contiguous_of, _made_in_runs

__all__ = [
    "spec_views",
    "small_views",
    "views_and_extents",
    "plain_extents",
    "column_extents",
    "Extents",
    "SpecColumns",
]

#: Beyond this many elements (or bytes) a claim is checked one by one with Python ints
#: (numpy's int64 sums could wrap): no real tensor comes near it.
_BIG = 1 << 56


def _given_contiguous(shapes: Sequence[tuple[int, ...]], strides: Sequence[Any], distinct: set) -> bool:
    """Whether every one of ``strides`` is a tuple of ints equal to the C-contiguous strides of its
    shape (each distinct shape's computed once): then the leaves take the path of ``strides=None``."""
    if set(map(type, strides)) != {tuple} or not set(map(type, chain.from_iterable(strides))) <= {int}:
        return False
    table = dict(zip(distinct, _contiguous_of(list(distinct))))
    return list(map(table.__getitem__, shapes)) == list(strides)


def _strided(shape: tuple[int, ...], st: Any) -> tuple[bool, int, bool, tuple[int, ...]]:
    """``(valid, span in elements (-1: the element count), C-contiguous, element strides)`` of
    a leaf of ``shape`` with strides ``st`` (None: contiguous)."""
    contiguous = _contiguous_of([shape])[0]
    if st is None:
        return True, -1, True, contiguous
    if (
        not isinstance(st, (tuple, list))
        or len(st) != len(shape)
        or not all(type(x) is int and 0 <= x < _BIG for x in st)
    ):
        return False, -1, shape == (), ()
    st = tuple(st)
    return True, sum((d - 1) * x for d, x in zip(shape, st)) + 1, st == contiguous, st


class Extents(NamedTuple):
    """What :func:`plain_extents` found, one row per spec (placeholders where ``ok`` is False)."""

    ok: np.ndarray  # bool: the bulk path takes it
    dense: np.ndarray  # bool: C-contiguous (strides None or the contiguous ones)
    dtypes: list[Any]
    shapes: list[tuple[int, ...]]
    strides: list[tuple[int, ...]]  # element strides, contiguous ones filled in
    offsets: np.ndarray  # int64 byte offsets
    itemsizes: np.ndarray  # int64
    numels: np.ndarray  # int64
    files: np.ndarray  # int64 file indices
    nbytes: np.ndarray  # int64 bytes the spec claims (0 where not ok)


def plain_extents(specs: Sequence[TensorSpec], files: Sequence[MappedFile]) -> Extents:
    """The leaves of ``specs`` the bulk path takes, checked in bulk (see :class:`Extents`).

    ``ok[i]`` is True for a STORED spec without loader whose shape and strides are
    well formed, that has elements, and whose bytes lie inside its file and cover what
    its shape and strides span: when it is, :func:`~tdz_numba.tdz.sources.check_extent`
    passes too; when not, :func:`~tdz_numba.tdz.sources.tensor_from_spec` says why.
    """
    n = len(specs)
    _, dtypes, shapes, strides, fidx, offsets, nbytes, _, codecs, _, _, loaders = zip(*specs)
    ok = np.ones(n, bool)
    if loaders.count(None) != n or codecs.count("stored") != n:
        ok &= np.fromiter((ld is None and c == "stored" for ld, c in zip(loaders, codecs)), bool, n)
    if set(map(type, shapes)) != {tuple}:
        ok &= np.fromiter((isinstance(s, (tuple, list)) for s in shapes), bool, n)
        shapes = tuple(s if type(s) is tuple else tuple(s) if isinstance(s, list) else () for s in shapes)
    dim_types = set(map(type, chain.from_iterable(shapes)))
    # only ints: equal shapes hold equal values, so the distinct ones tell the smallest dimension
    if dim_types and (dim_types != {int} or min(min(s) for s in set(shapes) if s) < 0):
        ok &= np.fromiter((all(type(d) is int and d >= 0 for d in s) for s in shapes), bool, n)
        shapes = tuple(s if good else () for s, good in zip(shapes, ok.tolist()))
    distinct = set(shapes)  # tuples of ints (True == 1 cannot merge two of them: no bools left)
    prod_of = {s: math.prod(s) for s in distinct}
    prods: Iterable[int] = (
        repeat(prod_of[shapes[0]], n) if len(distinct) == 1 else list(map(prod_of.__getitem__, shapes))
    )
    sizes = {d: d.itemsize for d in set(dtypes)}
    if len(sizes) == 1:
        isz = np.full(n, sizes[dtypes[0]], np.int64)
    else:
        isz = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, n)
    nfiles = len(files)
    file_set = set(fidx)
    if file_set - set(range(nfiles)):
        ok &= np.fromiter((type(i) is int and 0 <= i < nfiles for i in fidx), bool, n)
        fidx = tuple(i if good else 0 for i, good in zip(fidx, ok.tolist()))
        file_set = set(fidx)
    try:
        off = np.fromiter(offsets, np.int64, n)
        nb = np.fromiter(nbytes, np.int64, n)
        cnt = np.fromiter(prods, np.int64, n)
    except (OverflowError, TypeError, ValueError):  # a claim beyond int64 (or not an int): one by one
        prods = list(map(prod_of.__getitem__, shapes))
        big = np.fromiter(
            (
                not (type(o) is int and type(b) is int and type(c) is int)
                or max(abs(o), abs(b), abs(c)) >= _BIG
                for o, b, c in zip(offsets, nbytes, prods)
            ),
            bool,
            n,
        )
        ok &= ~big
        off = np.fromiter((0 if x else o for o, x in zip(offsets, big.tolist())), np.int64, n)
        nb = np.fromiter((0 if x else b for b, x in zip(nbytes, big.tolist())), np.int64, n)
        cnt = np.fromiter((0 if x else c for c, x in zip(prods, big.tolist())), np.int64, n)
    ok &= (cnt > 0) & (cnt < _BIG) & (off >= 0) & (off < _BIG) & (nb >= 0) & (nb < _BIG)
    nstrided = n - strides.count(None)
    given_dense: list[tuple[int, ...]] | None = None
    if nstrided == n and _given_contiguous(shapes, strides, distinct):
        # every leaf's strides given and C-contiguous (a .pt state dict): the path of strides=None
        nstrided, given_dense = 0, list(strides)
    dense = np.ones(n, bool)
    if nstrided:
        span_el = cnt.copy()
        pairs = list(zip(shapes, strides))
        given = [st for st in strides if st is not None]
        kinds: dict[Any, Any] | None = None
        if set(map(type, given)) == {tuple} and set(map(type, chain.from_iterable(given))) <= {int}:
            kinds = dict.fromkeys(pairs)  # only ints: no two distinct strides compare equal
        if kinds is not None:  # per distinct (shape, strides): valid, span, dense, element strides
            for shape, st in kinds:
                kinds[shape, st] = _strided(shape, st)
            good, spans, dense_rows, element_rows = zip(*map(kinds.__getitem__, pairs))
            ok &= np.fromiter(good, bool, n)
            given_span = np.fromiter(spans, np.int64, n)
            span_el = np.where(given_span >= 0, given_span, span_el)
            dense = np.fromiter(dense_rows, bool, n)
            elements: list[tuple[int, ...]] = list(element_rows)
        else:
            elements = []
            for i, (shape, st) in enumerate(pairs):
                g, sp, d, e = _strided(shape, st)
                ok[i] &= g
                if sp >= 0:
                    span_el[i] = sp
                dense[i] = d
                elements.append(e)
        ok &= span_el < _BIG
        need = span_el * isz
    else:
        if given_dense is not None:
            elements = given_dense
        elif len(distinct) == 1:
            elements = [_contiguous_of([shapes[0]])[0]] * n
        else:
            elements = _contiguous_of(shapes)
        need = cnt * isz
    file_rows = np.zeros(n, np.int64) if file_set == {0} else np.fromiter(fidx, np.int64, n)
    fsize = np.array([f.size for f in files] or [0], np.int64)[file_rows]
    ok &= (nb >= need) & (off + nb <= fsize)
    return Extents(
        ok, dense, list(dtypes), list(shapes), elements, off, isz, cnt, file_rows, np.where(ok, nb, 0)
    )


class SpecColumns(NamedTuple):
    """The fields of stored, loader-less, C-contiguous ``specs`` as the reader that made them
    (:func:`~tdz_numba.formats._flat.make_specs`) had them: columns of plain ints, tuples of
    non-negative ints and torch dtypes it checked, so :func:`column_extents` need not take the
    specs apart again; the extents are still checked here against the files."""

    specs: list[TensorSpec]  # the specs made from these columns, in order
    dtypes: Sequence[Any]
    shapes: Sequence[tuple[int, ...]]
    file: int | Sequence[int]
    offsets: Sequence[int]
    nbytes: Sequence[int]


def column_extents(cols: SpecColumns, files: Sequence[MappedFile]) -> Extents | None:
    """:func:`plain_extents` of ``cols.specs`` from the reader's columns (the same :class:`Extents`:
    every spec's bytes checked to lie inside its file and to cover its shape), or None where the
    columns are not what the specs hold in the form this takes (then :func:`plain_extents`)."""
    n = len(cols.specs)
    try:
        shapes, dtypes = list(cols.shapes), list(cols.dtypes)
        if not n or len(shapes) != n or len(dtypes) != n or len(cols.offsets) != n or len(cols.nbytes) != n:
            return None
        off = np.array(cols.offsets, np.int64)
        nb = np.array(cols.nbytes, np.int64)
        if isinstance(cols.file, int):
            if not 0 <= cols.file < len(files):
                return None
            file_rows = np.full(n, cols.file, np.int64)
        else:
            file_rows = np.array(cols.file, np.int64)
            if file_rows.shape != (n,) or ((file_rows < 0) | (file_rows >= len(files))).any():
                return None
    except (OverflowError, TypeError, ValueError):
        return None
    if off.shape != (n,) or nb.shape != (n,):
        return None
    try:
        distinct = set(shapes)
    except TypeError:  # a shape that is not a tuple
        return None
    if set(map(type, distinct)) != {tuple}:
        return None
    # every dimension an int (its type, not a set of values: True would merge into 1), none
    # negative; C-level passes, no generator frame per shape
    if not set(map(type, chain.from_iterable(distinct))) <= _INT:
        return None
    if min(chain.from_iterable(distinct), default=0) < 0:
        return None
    if len(distinct) == 1:
        shape = shapes[0]
        counts: Iterable[int] = (math.prod(shape),)
        cnt = np.full(n, math.prod(shape), np.int64)
        elements = [_contiguous_of([shape])[0]] * n
    else:
        prod_of = {s: math.prod(s) for s in distinct}
        counts = prod_of.values()
        cnt = np.fromiter(map(prod_of.__getitem__, shapes), np.int64, n)
        kinds = list(distinct)
        strides_of = dict(zip(kinds, _contiguous_of(kinds)))  # (not a set() of every row again)
        elements = list(map(strides_of.__getitem__, shapes))
    sizes = {d: d.itemsize for d in set(dtypes)}
    if len(sizes) == 1:
        isz = np.full(n, sizes[dtypes[0]], np.int64)
    else:
        isz = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, n)
    if (isinstance(cols.file, int) or len(files) == 1) and _all_inside(
        counts, off, nb, cnt * isz, files[int(file_rows[0])].size
    ):
        # every row passes (the common case): what the row-wise checks below give, in ~8 numpy
        # calls instead of ~25 (each costs several us with cold CPU caches, whatever the row count)
        return Extents(
            np.ones(n, bool), np.ones(n, bool), dtypes, shapes, elements, off, isz, cnt, file_rows, nb
        )
    ok = (cnt > 0) & (cnt < _BIG) & (off >= 0) & (off < _BIG) & (nb >= 0) & (nb < _BIG)
    fsize = np.array([f.size for f in files] or [0], np.int64)[file_rows]
    ok &= (nb >= cnt * isz) & (off + nb <= fsize)
    return Extents(
        ok, np.ones(n, bool), dtypes, shapes, elements, off, isz, cnt, file_rows, np.where(ok, nb, 0)
    )


def _all_inside(
    counts: Iterable[int], off: np.ndarray, nb: np.ndarray, need: np.ndarray, file_size: int
) -> bool:
    """Whether every row passes :func:`column_extents`' checks: element counts (``counts``, one per
    distinct shape) in ``(0, _BIG)``, offsets and byte counts in ``[0, _BIG)``, at least ``need``
    bytes each, inside a file of ``file_size`` bytes. False sends the caller to the row-wise
    checks (which say which rows fail; they also pass the rows of a file of ``_BIG`` bytes or
    more whose ends lie beyond ``_BIG``).

    With the counts checked, ``need`` (``cnt * itemsize``) is at least 1 and never wraps, so
    ``nb >= need`` holds only for ``nb >= 1``; with ``off >= 0`` too, ``off + nb`` wraps (past
    2**63, to a negative value) only when its minimum is negative; otherwise both lie below the
    ends, which lie below ``_BIG`` and inside the file."""
    if not all(0 < c < _BIG for c in counts) or _MIN(off) < 0 or not _ALL(nb >= need):
        return False
    ends = off + nb
    return bool(_MIN(ends) >= 0) and _MAX(ends) <= min(file_size, _BIG - 1)


#: The reductions of :func:`_all_inside` as the ufuncs' own (no Python frame of ``ndarray.min``).
_MIN, _MAX, _ALL = np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce


def spec_views(
    specs: Sequence[TensorSpec], files: Sequence[MappedFile], *, aligned: bool = False
) -> list[Any]:
    """Zero-copy tensors of many specs: ``out[i]`` is what ``tensor_from_spec(specs[i], files,
    aligned=aligned)`` returns, or None where that call must make it (see the module).

    With ``aligned=True`` leaves whose offset is not a multiple of their element size
    come back as None too (the one-by-one path copies them).
    """
    return views_and_extents(specs, files, aligned=aligned)[0]


def views_and_extents(
    specs: Sequence[TensorSpec],
    files: Sequence[MappedFile],
    *,
    aligned: bool = False,
    columns: SpecColumns | None = None,
) -> tuple[list[Any], Extents | None]:
    """:func:`spec_views` and the :class:`Extents` it checked (None when ``specs`` is empty):
    what a caller that hints the leaves' bytes ahead needs, without taking the specs apart again.
    ``columns``: the reader's columns of ``specs`` (``columns.specs`` must be ``specs``, the same
    objects in order; else they are not used), checked by :func:`column_extents`."""
    n = len(specs)
    if n == 0:
        return [], None
    if n <= SMALL:
        return small_views(specs, files, aligned=aligned), None
    was = gc.isenabled()
    gc.disable()  # tens of thousands of new tensors: no cycles among them, the collector's passes cost
    try:
        ext = None
        if columns is not None and len(columns.specs) == n and all(map(_is, specs, columns.specs)):
            ext = column_extents(columns, files)
        if ext is None:
            ext = plain_extents(specs, files)
        ok, dtypes, shapes, strides, off, isz = (
            ext.ok,
            ext.dtypes,
            ext.shapes,
            ext.strides,
            ext.offsets,
            ext.itemsizes,
        )
        quot, shift = np.divmod(off, isz)  # (element offsets and byte shifts in one pass)
        dset = set(dtypes)
        if aligned:
            ok &= shift == 0
        elif any(d.is_complex for d in dset):  # complex leaves need alignment (needs_alignment)
            ok &= (shift == 0) | ~np.fromiter(map(needs_alignment, dtypes), bool, n)
        every = bool(ok.all())  # (the common case: no row index arrays)
        rows = None if every else np.flatnonzero(ok)
        m = n if rows is None else rows.size
        out: list[Any] = [None] * n
        if not m:
            return out, ext
        fidx = ext.files if len(files) > 1 else None
        # one typed view per (file, dtype, shift): a small table, looked up per leaf
        codes = {d: i for i, d in enumerate(dset)}
        if len(codes) == 1 and fidx is None:  # one dtype, one file: the key is the shift
            key = shift
        else:
            dcode = np.fromiter(map(codes.__getitem__, dtypes), np.int64, n)
            key = dcode * 64 + shift
            if fidx is not None:
                key = key + fidx * (64 * len(codes))
        sel = key if rows is None else key[rows]
        first = int(sel[0])
        if (sel == first).all():  # one dtype, one file, one shift: the common case
            kinds, inverse = np.array([first]), None
        else:
            kinds, inverse = np.unique(sel, return_inverse=True)
        by_code = {i: d for d, i in codes.items()}
        table = []
        for k in kinds.tolist():
            f = files[k // (64 * len(codes))] if fidx is not None else files[0]
            table.append(f.typed(by_code[(k // 64) % len(codes)], k % 64))
        views = [table[0]] * m if inverse is None else list(map(table.__getitem__, inverse.tolist()))
        if rows is None:
            at = quot
            sel_shapes, sel_strides = shapes, strides
        else:
            at = quot[rows]
            pick = rows.tolist()
            sel_shapes = [shapes[i] for i in pick]
            sel_strides = [strides[i] for i in pick]
        elem = at.tolist()
        with own_views():
            made = None
            if _sources._GUARD and m >= max(2 * _RUN, _RUNS_FROM):
                tidx = np.zeros(m, np.int64) if inverse is None else inverse.reshape(-1)
                made = _made_in_runs(table, tidx, sel_shapes, sel_strides, at)
            if made is not None:
                pass
            elif _sources._GUARD:
                made = list(map(_AS_STRIDED(), views, sel_shapes, sel_strides, elem))
            else:
                made = list(map(leaf_view, views, sel_shapes, sel_strides, elem))
        if rows is None:
            return made, ext
        for i, t in zip(pick, made):
            out[i] = t
        return out, ext
    finally:
        if was:
            gc.enable()


#: Most leaves :func:`views_and_extents` makes one by one (:func:`small_views`): its ~30 numpy
#: calls cost ~30 us whatever the count, the loop ~1.7 us a leaf against ~0.7 (measured: 1 leaf
#: 4 us against 31, 16 leaves 36 against 49, 32 leaves 63 against 65).
SMALL = 24
_INT = {int}


def small_views(
    specs: Sequence[TensorSpec], files: Sequence[MappedFile], *, aligned: bool = False
) -> list[Any]:
    """:func:`spec_views` leaf by leaf, in plain Python (few leaves: see :data:`SMALL`): a view
    where the bulk path makes one (every field a plain ``int``/``tuple`` of the checks of
    :func:`plain_extents`: STORED, no loader, elements, bytes inside the file covering the span),
    None elsewhere (the caller's :func:`~tdz_numba.tdz.sources.tensor_from_spec` makes it or
    raises); the same tensors (storage, offset, shape, strides, own version counter).

    >>> import tempfile, pathlib, numpy as np, torch
    >>> from tdz_numba.tdz.sources import MappedFile, TensorSpec
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = pathlib.Path(d) / "raw.bin"
    ...     _ = p.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    ...     f = MappedFile.open(p)
    ...     a, b = small_views([TensorSpec("a", torch.float32, (2,), (2,), 0, 0, 12),
    ...                         TensorSpec("b", torch.float32, (5,), None, 0, 0, 20)], [f])
    ...     print(a.tolist(), b)
    [0.0, 2.0] None
    """
    out: list[Any] = []
    nfiles = len(files)
    shaped: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}  # checked shape: (numel, strides)
    with own_views():
        for spec in specs:
            _, dtype, shape, strides, fi, off, nb, _, codec, _, _, loader = spec
            if (
                loader is not None
                or codec != "stored"
                or type(shape) is not tuple
                or type(fi) is not int
                or type(off) is not int
                or type(nb) is not int
                or not (0 <= fi < nfiles and 0 <= off < _BIG and 0 <= nb < _BIG)
                or not set(map(type, shape)) <= _INT  # (then equal shapes hold equal ints: the table)
            ):
                out.append(None)
                continue
            got = shaped.get(shape)
            if got is None:
                numel = math.prod(shape)
                if min(shape, default=0) < 0 or not 0 < numel < _BIG:
                    out.append(None)
                    continue
                got = shaped[shape] = numel, _contiguous_of([shape])[0]
            span, st = got
            if strides is not None:
                if (
                    type(strides) is not tuple
                    or len(strides) != len(shape)
                    or not set(map(type, strides)) <= _INT
                    or min(strides, default=0) < 0
                    or max(strides, default=0) >= _BIG
                ):
                    out.append(None)
                    continue
                span, st = sum((d - 1) * x for d, x in zip(shape, strides)) + 1, strides
            isz = dtype.itemsize
            f = files[fi]
            shift = off % isz
            if (
                span >= _BIG
                or nb < span * isz
                or off + nb > f.size
                or (shift and (aligned or needs_alignment(dtype)))
            ):
                out.append(None)
                continue
            out.append(leaf_view(f.typed(dtype, shift), shape, st, off // isz))
    return out
