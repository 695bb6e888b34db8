"""The Numba twin of the regex pass of :mod:`~tdz_numba.formats.safetensors`' fast header path:
the entries of a header in safetensors' own writer layout, read in one compiled pass into columns.

:func:`scan_entries` reads ``"name":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]}``
entries separated by commas that must tile the body exactly (the regex ``_ENTRY`` of
:mod:`~tdz_numba.formats.safetensors` and its tiling check: names without ``"``, ``\\`` or
control bytes, dtypes of 1-16 ``[A-Z0-9_]``, ints of at most 18 digits without leading zeros),
copies the names, dtype texts and shape texts into three NUL-separated buffers (one ``decode``
and one ``split`` each in Python: no name holds a NUL) and parses the offsets into int64
columns. :func:`entries` gives what the regex pass gives, or None where the regex pass would
not take the body either.

Examples
--------
>>> from tdz_numba.formats.safetensors_scan import entries
>>> body = '"a":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]}'
>>> names, tnames, shapes, begins, ends = entries(body)
>>> names, tnames, shapes, begins.tolist(), ends.tolist()
(['a'], ['F16'], ['2,3'], [0], [12])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from ..jit.presets import KERNEL

__all__ = ["scan_entries", "entries"]

_AFTER_NAME = np.frombuffer(b'":{"dtype":"', np.uint8)
_AFTER_DTYPE = np.frombuffer(b'","shape":[', np.uint8)
_AFTER_SHAPE = np.frombuffer(b'],"data_offsets":[', np.uint8)
#: Characters of an entry outside its five fields (``len('"":{"dtype":"","shape":[],"data_offsets":[,]}')``).
_FIXED = 45


@njit(**KERNEL)
def _literal(buf, pos, end, lit):  # pragma: no cover - compiled
    """The position after ``lit`` at ``pos``, or -1 when ``buf[pos:]`` does not start with it."""
    k = lit.size
    if pos + k > end:
        return -1
    for i in range(k):
        if buf[pos + i] != lit[i]:
            return -1
    return pos + k


@njit(**KERNEL)
def _int(buf, pos, end):  # pragma: no cover - compiled
    """``(value, new pos)`` of ``0|[1-9][0-9]{0,17}`` at ``pos``; new pos -1 when there is none."""
    if pos >= end:
        return 0, -1
    c = buf[pos]
    if c == 48:  # "0": a digit may not follow (the regex then fails at the next literal)
        return 0, pos + 1
    if c < 49 or c > 57:
        return 0, -1
    value = 0
    k = 0
    while pos < end and 48 <= buf[pos] <= 57:
        if k == 18:
            return 0, -1
        value = value * 10 + (buf[pos] - 48)
        pos += 1
        k += 1
    return value, pos


@njit(**KERNEL)
def scan_entries(buf, offsets, names, dtypes, shapes, out):  # pragma: no cover - compiled
    """Reads the entries tiling ``buf`` (see the module) into ``offsets[i] = (begin, end)`` and the
    three NUL-separated buffers. ``out``: ``[ok, entries, names bytes, dtypes bytes, shapes bytes]``;
    ``ok`` 0 when ``buf`` is not such a body or a buffer is too small (sized from ``buf``: never)."""
    end = buf.size
    out[0] = 0
    pos = 0
    n = 0
    nn = 0
    nd = 0
    ns = 0
    while True:
        if n >= offsets.shape[0] or pos >= end or buf[pos] != 34:  # '"'
            return
        pos += 1
        while True:  # the name: up to the next '"'
            if pos >= end or nn >= names.size:
                return
            c = buf[pos]
            if c == 34:
                break
            if c < 32 or c == 92:
                return
            names[nn] = c
            nn += 1
            pos += 1
        if nn >= names.size:
            return
        names[nn] = 0
        nn += 1
        pos = _literal(buf, pos, end, _AFTER_NAME)
        if pos < 0:
            return
        k = 0
        while pos < end and ((65 <= buf[pos] <= 90) or (48 <= buf[pos] <= 57) or buf[pos] == 95):
            if k == 16 or nd >= dtypes.size:
                return
            dtypes[nd] = buf[pos]
            nd += 1
            pos += 1
            k += 1
        if k == 0 or nd >= dtypes.size:
            return
        dtypes[nd] = 0
        nd += 1
        pos = _literal(buf, pos, end, _AFTER_DTYPE)
        if pos < 0:
            return
        first = pos
        if pos < end and buf[pos] != 93:  # not "]": ints separated by commas
            while True:
                _, pos = _int(buf, pos, end)
                if pos < 0 or pos >= end:
                    return
                if buf[pos] != 44:
                    break
                pos += 1
        if ns + pos - first >= shapes.size:
            return
        for i in range(first, pos):
            shapes[ns] = buf[i]
            ns += 1
        shapes[ns] = 0
        ns += 1
        pos = _literal(buf, pos, end, _AFTER_SHAPE)
        if pos < 0:
            return
        begin, pos = _int(buf, pos, end)
        if pos < 0 or pos >= end or buf[pos] != 44:
            return
        stop, pos = _int(buf, pos + 1, end)
        if pos < 0 or pos + 2 > end or buf[pos] != 93 or buf[pos + 1] != 125:  # "]}"
            return
        pos += 2
        offsets[n, 0] = begin
        offsets[n, 1] = stop
        n += 1
        if pos == end:
            break
        if buf[pos] != 44:
            return
        pos += 1
    out[0] = 1
    out[1] = n
    out[2] = nn
    out[3] = nd
    out[4] = ns


def entries(body: str) -> tuple[list[str], list[str], list[str], np.ndarray, np.ndarray] | None:
    """``(names, dtype texts, shape texts, begins, ends)`` of the entries tiling ``body`` (the text
    between the header's braces, after any ``__metadata__``), or None when they do not tile it."""
    raw = body.encode("utf-8")
    if not raw:
        return None
    buf = np.frombuffer(raw, np.uint8)
    buf.flags.writeable = False  # one compiled signature for every header
    rows = len(raw) // _FIXED + 1
    offsets = np.empty((rows, 2), np.int64)
    size = len(raw) + 1
    names = np.empty(size, np.uint8)
    dtypes = np.empty(size, np.uint8)
    shapes = np.empty(size, np.uint8)
    out = np.zeros(5, np.int64)
    scan_entries(buf, offsets, names, dtypes, shapes, out)
    if not out[0]:
        return None
    n = int(out[1])
    split = _split
    return (
        split(names, out[2]),
        split(dtypes, out[3]),
        split(shapes, out[4]),
        offsets[:n, 0],
        offsets[:n, 1],
    )


def _split(buf: Any, used: Any) -> list[str]:
    """The NUL-terminated texts in ``buf[:used]``."""
    return buf[: int(used) - 1].tobytes().decode("utf-8").split("\0")
