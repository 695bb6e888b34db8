"""The Numba twin of the record walk of :func:`~tdz_numba.formats.gguf_bulk.bulk_infos`: where each
GGUF tensor info starts, in one compiled pass.

A tensor info is ``name length (u64), name, n_dims (u32), n_dims x u64, ggml type (u32),
offset (u64)``. :func:`walk_infos` reads what locates the next record (the name's length, the
dimension count), exactly as the Python loop does (the same bounds, the same refusals), and
copies the names into one NUL-separated buffer (one ``decode`` and one ``split`` in Python).

Examples
--------
>>> import numpy as np, struct
>>> from tdz_numba.formats.gguf_scan import walk
>>> rec = struct.pack("<Q", 1) + b"w" + struct.pack("<I2QIQ", 2, 3, 2, 0, 0)
>>> starts, ends, ndims, names, end = walk(np.frombuffer(rec * 2, np.uint8), 0, 2, 4)
>>> starts.tolist(), ndims.tolist(), names, end
([8, 49], [2, 2], ['w', 'w'], 82)
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..jit.presets import KERNEL

__all__ = ["walk_infos", "walk", "gather_rows", "rows"]


@njit(**KERNEL)
def _u64(buf, p):  # pragma: no cover - compiled
    v = np.uint64(0)
    for i in range(8):
        v |= np.uint64(buf[p + i]) << np.uint64(8 * i)
    return v


@njit(**KERNEL)
def walk_infos(buf, pos, n, max_dims, starts, ends, ndims, names, out):  # pragma: no cover - compiled
    """Walks ``n`` records from ``pos``; ``out`` = ``[ok, end, bytes of names, a name holds a NUL]``
    (``ok`` 0 where the Python walk returns None, 2 when ``names`` is full)."""
    size = buf.size
    out[0] = 0
    at = 0
    nul = 0
    for i in range(n):
        if pos + 8 > size:
            return
        ln = _u64(buf, pos)
        if ln > np.uint64(size):
            return
        a = pos + 8
        pos = a + np.int64(ln)
        if pos + 4 > size:
            return
        nd = np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8) | (np.int64(buf[pos + 2]) << 16)
        nd |= np.int64(buf[pos + 3]) << 24
        if nd > max_dims:
            return
        starts[i] = a
        ends[i] = pos
        ndims[i] = nd
        if at + (pos - a) + 1 > names.size:
            out[0] = 2
            return
        for j in range(a, pos):
            c = buf[j]
            if c == 0:
                nul = 1
            names[at] = c
            at += 1
        names[at] = 0
        at += 1
        pos += 16 + 8 * nd
    if pos > size or n == 0:
        return
    out[0] = 1
    out[1] = pos
    out[2] = at
    out[3] = nul


def walk(
    buf: np.ndarray, pos: int, n: int, max_dims: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], int] | None:
    """``(name starts, name ends, dimension counts, names, end of the last record)`` of ``n``
    records from byte ``pos`` of ``buf`` (uint8), or None where the Python walk returns None.
    Names decode as UTF-8 with replacement, one by one where one holds a NUL or a bad byte."""
    arr = buf if not buf.flags.writeable else buf.view()
    arr.flags.writeable = False  # one compiled signature
    size = arr.size
    if n < 0 or n > size // 12:  # a record takes 12 bytes at least (length, dimension count)
        return None
    starts, ends, ndims = (np.empty(n, np.int64) for _ in range(3))
    out = np.zeros(4, np.int64)
    room = min(64 * n, size) + 1  # names of up to 63 bytes; else a second pass with room for all
    for _ in range(2):
        names = np.empty(room, np.uint8)
        walk_infos(arr, pos, n, max_dims, starts, ends, ndims, names, out)
        if out[0] != 2:
            break
        room = size + n + 1
    if out[0] != 1:
        return None
    text = names[: int(out[2]) - 1].tobytes()
    decoded: list[str] | None = None
    if not out[3]:
        try:
            decoded = text.decode("utf-8").split("\0")
        except UnicodeDecodeError:
            decoded = None
    if decoded is None:
        mv = arr.data
        decoded = [str(mv[a:b], "utf-8", "replace") for a, b in zip(starts.tolist(), ends.tolist())]
    return starts, ends, ndims, decoded, int(out[1])


#: Most distinct ``(type, dims)`` rows :func:`gather_rows` groups itself (a model has a dozen;
#: beyond it the caller's sort-based grouping is faster than comparing with every row kept).
MAX_KINDS = 64


@njit(**KERNEL)
def gather_rows(
    buf, ends, ndims, size, alignment, rows, offsets, inverse, first, out
):  # pragma: no cover - compiled
    """For walked records (``ends``: where each name ends, ``ndims``: dimension counts), fills
    ``rows[i] = (ggml type, n_dims, dims...)`` and ``offsets[i]``, and groups equal rows:
    ``inverse[i]`` the group of row ``i``, ``first[k]`` the first row of group ``k``.
    ``out = [status, groups]``: status 1 done, 0 an offset at or past ``size`` or not a
    multiple of ``alignment``, 2 more than ``first.size`` groups (``inverse`` incomplete)."""
    n = ends.size
    width = rows.shape[1]
    out[0] = 0
    kinds = 0
    status = 1
    for i in range(n):
        at = ends[i] + 4
        nd = ndims[i]
        for j in range(width):
            rows[i, j] = 0
        for j in range(nd):
            rows[i, 2 + j] = _u64(buf, at + 8 * j)
        p = at + 8 * nd
        rows[i, 0] = np.uint64(buf[p]) | (np.uint64(buf[p + 1]) << np.uint64(8))
        rows[i, 0] |= (np.uint64(buf[p + 2]) << np.uint64(16)) | (np.uint64(buf[p + 3]) << np.uint64(24))
        rows[i, 1] = np.uint64(nd)
        off = _u64(buf, p + 4)
        if off >= np.uint64(size) or off % np.uint64(alignment):
            return
        offsets[i] = np.int64(off)
        if status != 1:
            continue
        k = 0
        while k < kinds:
            r = first[k]
            same = True
            for j in range(width):
                if rows[r, j] != rows[i, j]:
                    same = False
                    break
            if same:
                break
            k += 1
        if k == kinds:
            if kinds == first.size:
                status = 2
                continue
            first[kinds] = i
            kinds += 1
        inverse[i] = k
    out[0] = status
    out[1] = kinds


def rows(
    buf: np.ndarray, ends: np.ndarray, ndims: np.ndarray, alignment: int, max_dims: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """``(rows, offsets, distinct, inverse)`` of records :func:`walk` found (see
    :func:`gather_rows`; ``distinct``/``inverse`` None beyond :data:`MAX_KINDS` kinds), or None
    where an offset is out of the file or misaligned (the Python path returns None too)."""
    arr = buf if not buf.flags.writeable else buf.view()
    arr.flags.writeable = False  # one compiled signature
    n = ends.size
    table = np.empty((n, 2 + max_dims), np.uint64)
    offsets = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    first = np.empty(MAX_KINDS, np.int64)
    out = np.zeros(2, np.int64)
    gather_rows(arr, ends, ndims, arr.size, alignment, table, offsets, inverse, first, out)
    if out[0] == 0:
        return None
    if out[0] == 2:
        return table, offsets, None, None
    return table, offsets, table[first[: int(out[1])]], inverse
