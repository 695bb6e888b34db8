"""The Numba twin of :func:`~tdz_numba.formats.onnx_bulk.compact_graph`: a ``GraphProto`` whose
initializers are all compact, read in one compiled pass into columns.

:func:`scan_graph` walks the graph's fields and each initializer's fields exactly as
:func:`~tdz_numba.formats.onnx_bulk.compact_graph` and
:func:`~tdz_numba.formats.onnx_bulk.compact_tensor` do (the same varint rules, the same
refusals, the last of a repeated field wins) and fills, per initializer, the name's span,
``data_type``, the dims (into one array) and the ``raw_data`` span; the names are copied
into one NUL-separated buffer (one ``decode`` and one ``split`` in Python). Every read is
bounded by the graph's end. :func:`compact_graph` gives what the Python function gives.

Examples
--------
>>> from tdz_numba.formats.onnx_scan import compact_graph
>>> t = bytes([0x08, 2, 0x08, 3, 0x10, 1, 0x42, 1]) + b"w" + bytes([0x4A, 24]) + bytes(24)
>>> g = bytes([0x12, 1]) + b"g" + bytes([0x2A, len(t)]) + t
>>> compact_graph(memoryview(g), 0, len(g))
((2, 1), None, [('w', 1, (2, 3), 16, 24)], 2)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from ..jit.presets import KERNEL
from ._shape import MAX_NDIM
from .onnx_bulk import PROBE, Columns

__all__ = ["scan_graph", "graph_columns", "compact_graph", "NCOL"]

#: Columns per initializer: name offset, name length (-1: none), data_type, ndim, dims offset,
#: raw_data offset, raw_data length.
NCOL = 7
_LIMIT = np.uint64(1) << np.uint64(63)


@njit(**KERNEL)
def _varint(buf, pos, end):  # pragma: no cover - compiled
    """``(value, new pos, ok)``: a varint of at most 10 bytes, its value modulo 2**64."""
    value = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if pos >= end:
            return value, pos, False
        b = np.uint64(buf[pos])
        pos += 1
        if shift < 64:
            value |= (b & np.uint64(0x7F)) << shift
        if b < 0x80:
            return value, pos, True
        shift += np.uint64(7)
    return value, pos, False


@njit(**KERNEL)
def _tensor(buf, pos, end, row, cols, dims, nd, max_ndim):  # pragma: no cover - compiled
    """One compact ``TensorProto`` in ``buf[pos:end]`` into row ``row``: False when it is not one."""
    cols[row, 1] = -1
    cols[row, 2] = 0
    cols[row, 5] = -1
    start = nd[0]
    k = 0
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag == 0x08 or tag == 0x10:
            value, pos, ok = _varint(buf, pos, end)
            if not ok or value >= _LIMIT:
                return False
            if tag == 0x10:
                cols[row, 2] = np.int64(value)
            elif k < max_ndim and start + k < dims.size:
                dims[start + k] = np.int64(value)
                k += 1
            else:
                return False
        elif tag == 0x42 or tag == 0x4A:
            n, pos, ok = _varint(buf, pos, end)
            if not ok or n > np.uint64(end - pos):
                return False
            if tag == 0x42:
                cols[row, 0] = pos
                cols[row, 1] = np.int64(n)
            else:
                cols[row, 5] = pos
                cols[row, 6] = np.int64(n)
            pos += np.int64(n)
        else:
            return False
    if cols[row, 5] < 0:
        return False
    cols[row, 3] = k
    cols[row, 4] = start
    nd[0] = start + k
    return True


@njit(**KERNEL)
def scan_graph(buf, start, end, cols, dims, names, max_ndim, out):  # pragma: no cover - compiled
    """Scans the ``GraphProto`` in ``buf[start:end]``. ``out`` = ``[ok, initializers, fields,
    name offset, name length, doc offset, doc length, bytes of names, a name holds a NUL]``
    (spans -1 when absent); ``ok`` is 0 where ``compact_graph`` returns None, 2 when the
    output arrays are full."""
    out[0] = 0
    out[3] = out[4] = out[5] = out[6] = -1
    out[8] = 0
    pos = start
    rows = 0
    count = 0
    nd = np.zeros(1, np.int64)
    at = 0
    while pos < end:
        tag, pos, ok = _varint(buf, pos, end)
        if not ok or tag < 8:
            return
        wire = tag & np.uint64(7)
        count += 1
        if wire == 2:
            n, pos, ok = _varint(buf, pos, end)
            if not ok or n > np.uint64(end - pos):
                return
            field = tag >> np.uint64(3)
            m = np.int64(n)
            if field == 5:
                if rows >= cols.shape[0] or nd[0] + max_ndim > dims.size:
                    out[0] = 2
                    return
                if not _tensor(buf, pos, pos + m, rows, cols, dims, nd, max_ndim):
                    return
                k = cols[rows, 1]
                if k > 0:
                    if at + k + 1 > names.size:
                        out[0] = 2
                        return
                    p = cols[rows, 0]
                    for i in range(k):
                        c = buf[p + i]
                        if c == 0:
                            out[8] = 1
                        names[at + i] = c
                    at += k
                names[at] = 0
                at += 1
                rows += 1
            elif field == 2:
                out[3] = pos
                out[4] = m
            elif field == 10:
                out[5] = pos
                out[6] = m
            pos += m
        elif wire == 0:
            _, pos, ok = _varint(buf, pos, end)
            if not ok:
                return
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
            if pos > end:
                return
        else:
            return
    out[0] = 1
    out[1] = rows
    out[2] = count
    out[7] = at


def graph_columns(buf: Any, start: int, end: int, scan: Any = None) -> tuple[Any, Any, Columns, int] | None:
    """What :func:`~tdz_numba.formats.onnx_bulk.compact_graph` returns with ``columns=True``,
    read by :func:`scan_graph`: the initializers as :class:`~tdz_numba.formats.onnx_bulk.Columns`
    straight from the kernel's arrays (one shape object shared when every initializer has it).
    ``scan`` (a :class:`~tdz_numba.files.scanadvice.header_scan` reading page by page): decided
    by the spacing of the first :data:`PROBE` initializers' data, read first."""
    arr = np.frombuffer(buf, np.uint8)
    arr.flags.writeable = False  # one compiled signature for every buffer
    size = end - start
    out = np.zeros(9, np.int64)
    if scan is not None and scan.active:
        scan.decide(_probe(arr, start, end, out))
    rows = size // 96 + 16  # an initializer of 10 KiB or more takes ~10 KiB: room for small ones too
    for _ in range(2):
        cols = np.empty((rows, NCOL), np.int64)
        dims = np.empty(2 * rows + MAX_NDIM, np.int64)
        names = np.empty(min(size, 64 * rows) + 1, np.uint8)
        scan_graph(arr, start, end, cols, dims, names, MAX_NDIM, out)
        if out[0] != 2:
            break
        rows = size // 4 + 16  # an initializer takes 4 bytes at least (tag, length, raw_data tag, length)
    if out[0] != 1:
        return None
    n = int(out[1])
    cols = cols[:n]
    text = names[: max(0, int(out[7]) - 1)].tobytes()
    split: list[str] | None = None
    if not out[8]:
        try:
            split = text.decode("utf-8").split("\0") if n else []
        except UnicodeDecodeError:
            split = None
    if split is None:  # a NUL or a bad byte in a name: one by one, as the Python reader decodes them
        split = [
            bytes(buf[a : a + k]).decode("utf-8", errors="replace") if k >= 0 else ""
            for a, k in zip(cols[:, 0].tolist(), cols[:, 1].tolist())
        ]
    shapes, distinct = _shapes(cols[:, 3], cols[:, 4], dims, n)
    span = lambda a, b: None if a < 0 else (int(a), int(b))  # noqa: E731
    col = lambda j: np.ascontiguousarray(cols[:, j])  # noqa: E731 - not a view of the scan's rows
    inits = Columns(split, col(2), shapes, col(5), col(6), distinct)
    return span(out[3], out[4]), span(out[5], out[6]), inits, int(out[2])


def _probe(arr: np.ndarray, start: int, end: int, out: np.ndarray) -> float:
    """Mean bytes from one initializer's data to the next over the first :data:`PROBE`
    (:func:`scan_graph` stopped when its rows are full; fewer in the graph: its size, the
    scan page by page being the cheaper)."""
    cols = np.full((PROBE, NCOL), -1, np.int64)
    dims = np.empty(PROBE * MAX_NDIM + MAX_NDIM, np.int64)
    names = np.empty(min(end - start, 1 << 20) + 1, np.uint8)
    scan_graph(arr, start, end, cols, dims, names, MAX_NDIM, out)
    first, last = int(cols[0, 5]), int(cols[PROBE - 1, 5])
    if out[0] != 2 or first < 0 or last < first:
        return float(end - start)
    return (last - first) / (PROBE - 1)


def _shapes(
    ndim: np.ndarray, at: np.ndarray, dims: np.ndarray, n: int
) -> tuple[list[tuple[int, ...]], set[tuple[int, ...]] | None]:
    """The initializers' shapes from the kernel's ranks, dims offsets and dims, and the set of
    the distinct ones when that costs nothing (every initializer of one shape)."""
    if not n:
        return [], set()
    k = int(ndim[0])
    if not k and not ndim.any():  # every initializer a scalar
        return [()] * n, {()}
    if k and (ndim == k).all() and (at == at[0] + k * np.arange(n)).all():  # one rank, in a row
        first = int(at[0])
        block = dims[first : first + k * n].reshape(n, k)
        if (block == block[0]).all():
            shape = tuple(block[0].tolist())
            return [shape] * n, {shape}
        return list(map(tuple, block.tolist())), None
    flat = dims[: int(_nd_end(at, ndim))].tolist()
    return [tuple(flat[a : a + d]) for a, d in zip(at.tolist(), ndim.tolist())], None


def compact_graph(buf: Any, start: int, end: int) -> tuple[Any, Any, list[Any], int] | None:
    """What :func:`~tdz_numba.formats.onnx_bulk.compact_graph` returns, read by :func:`scan_graph`."""
    got = graph_columns(buf, start, end)
    if got is None:
        return None
    return got[0], got[1], got[2].tuples(), got[3]


def _nd_end(at: np.ndarray, ndim: np.ndarray) -> int:
    """One past the last dim used."""
    return int((at + ndim).max()) if at.size else 0
