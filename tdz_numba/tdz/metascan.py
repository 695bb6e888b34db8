"""A plain TensorDict ``meta.json`` in tensordict's own writer layout, read in one compiled pass.

tensordict (and :func:`tdz_numba.save`) write a level's ``meta.json`` with ``json.dump``: one
object per child, ``{"device": "cpu", "shape": [2, 3], "dtype": "torch.float32", "is_nested":
false}`` for a leaf and ``{"type": "TensorDict"}`` for a sub-level, then the level's own fields
(``"shape"``, ``"device"``, ``"_type"``, ...). :func:`scan_meta` reads the children of such a
text into columns: each key's bytes (into one NUL-separated buffer, and again with the suffix of
its entry name, ``.memmap`` or ``/``), a dtype code, a shape id (distinct shapes kept once), the
byte size; it stops at the first child whose value is not an object: the level's fields, which
Python decodes with :func:`~tdz_numba.tdz.bounds.parse_meta` (a few hundred bytes).
:func:`scan_level` turns the columns into the :class:`~tdz_numba.tdz.plainlevel.PlainLevel` that
``plain_td_level(parse_meta(data), prefix, has_meta)`` gives, or None for anything else: another
field order or extra fields, non-ASCII or escaped device/dtype texts, ints of more than 18
digits, more than :data:`MAX_DIMS` dimensions, an unknown dtype, a nested leaf, a duplicate key,
a level that is not a TensorDict. The caller then takes that path, which names what is wrong.

Examples
--------
>>> from tdz_numba.tdz.metascan import scan_level
>>> text = b'{"x": {"device": "cpu", "shape": [2, 3], "dtype": "torch.float32", "is_nested": false}, "shape": []}'
>>> lvl = scan_level(text, "", lambda name: True)
>>> lvl.names, lvl.nbytes, lvl.fields, lvl.items[0][3:]
(['x.memmap'], [24], {'shape': []}, ('torch.float32', (2, 3), (3, 1)))
>>> scan_level(b'{"x": {"dtype": "torch.float32", "shape": [2]}}', "", lambda name: True) is None
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from ..errors import BadArchiveError
from ..jit.presets import KERNEL
from .bounds import MAX_NBYTES, parse_meta
from .dtypes import dtype_table
from .keys import _ENCODED, encode_key
from .plainlevel import PlainLevel, contiguous_strides, td_fields_ok
from .tree import NON_TENSOR_DATA_TYPE, RESERVED_FIELDS

__all__ = ["MAX_DIMS", "scan_meta", "scan_level"]

#: Most dimensions of a leaf the scan reads (more: the parsing path).
MAX_DIMS = 16
#: ``rows`` columns: kind (0 leaf, 1 sub-level), flags, dtype code, shape id, bytes, itemsize.
_KIND, _FLAGS, _CODE, _SHAPE, _NBYTES, _ITEMSIZE = range(6)
#: Flags of a key: written with escapes (decoded in Python); its file name is not the key itself.
ESCAPED, ENCODED = 1, 2
_HASH_SLOTS = 4096  # distinct shapes looked up by hash (beyond half of it: one id per leaf)

_DEVICE = np.frombuffer(b'"device"', np.uint8)
_SHAPE_KEY = np.frombuffer(b'"shape"', np.uint8)
_DTYPE_KEY = np.frombuffer(b'"dtype"', np.uint8)
_NESTED_KEY = np.frombuffer(b'"is_nested"', np.uint8)
_TYPE_KEY = np.frombuffer(b'"type"', np.uint8)
_FALSE = np.frombuffer(b"false", np.uint8)
_NULL = np.frombuffer(b"null", np.uint8)
_MEMMAP = np.frombuffer(b".memmap", np.uint8)
# bytes of a key that tensordict's file-name encoding replaces ('"', '\\' and controls: see the kernel)
_UNSAFE = np.zeros(256, np.uint8)
for _c in b"/<>:|?* %\x7f":
    _UNSAFE[_c] = 1
_HEX = np.zeros(256, np.uint8)
for _c in b"0123456789abcdefABCDEF":
    _HEX[_c] = 1
_ESCAPES = np.zeros(256, np.uint8)
for _c in b'"\\/bfnrtu':
    _ESCAPES[_c] = 1


@njit(**KERNEL)
def _ws(buf, pos, end):  # pragma: no cover - compiled
    """The position of the first byte at or after ``pos`` that is not JSON whitespace (-1: -1)."""
    if pos < 0:
        return -1
    while pos < end:
        c = buf[pos]
        if c != 32 and c != 10 and c != 13 and c != 9:
            break
        pos += 1
    return pos


@njit(**KERNEL)
def _lit(buf, pos, end, lit):  # pragma: no cover - compiled
    """The position after ``lit`` at ``pos``, or -1 when ``buf[pos:]`` does not start with it."""
    k = lit.size
    if pos < 0 or pos + k > end:
        return -1
    for i in range(k):
        if buf[pos + i] != lit[i]:
            return -1
    return pos + k


@njit(**KERNEL)
def _colon(buf, pos, end):  # pragma: no cover - compiled
    """After whitespace, ``:`` and whitespace at ``pos``: the next position, or -1."""
    if pos < 0:
        return -1
    pos = _ws(buf, pos, end)
    if pos >= end or buf[pos] != 58:
        return -1
    return _ws(buf, pos + 1, end)


@njit(**KERNEL)
def _comma(buf, pos, end):  # pragma: no cover - compiled
    """After whitespace, ``,`` and whitespace at ``pos``: the next position, or -1."""
    if pos < 0:
        return -1
    pos = _ws(buf, pos, end)
    if pos >= end or buf[pos] != 44:
        return -1
    return _ws(buf, pos + 1, end)


@njit(**KERNEL)
def _ascii(buf, pos, end):  # pragma: no cover - compiled
    """The position after a string of printable ASCII without escapes at ``pos``, or -1."""
    if pos < 0 or pos >= end or buf[pos] != 34:
        return -1
    pos += 1
    while pos < end:
        c = buf[pos]
        if c == 34:
            return pos + 1
        if c < 32 or c > 126 or c == 92:
            return -1
        pos += 1
    return -1


@njit(**KERNEL)
def _key(buf, pos, end, unsafe, hexes, escapes):  # pragma: no cover - compiled
    """``(end of the text, flags)`` of the JSON string at ``pos`` (its closing quote's position), or -1."""
    if pos >= end or buf[pos] != 34:
        return -1, 0
    pos += 1
    flags = 0
    while pos < end:
        c = buf[pos]
        if c == 34:
            return pos, flags
        if c < 32:
            return -1, 0
        if c == 92:
            flags |= 3  # ESCAPED | ENCODED
            if pos + 1 >= end or not escapes[buf[pos + 1]]:
                return -1, 0
            if buf[pos + 1] == 117:  # \uXXXX
                if pos + 6 > end:
                    return -1, 0
                for j in range(2, 6):
                    if not hexes[buf[pos + j]]:
                        return -1, 0
                pos += 6
            else:
                pos += 2
            continue
        if unsafe[c]:
            flags |= 2
        pos += 1
    return -1, 0


@njit(**KERNEL)
def _dtype(buf, begin, stop, dt_text, dt_offs, last):  # pragma: no cover - compiled
    """The code of the dtype name ``buf[begin:stop]`` in the table (``last`` tried first), or -1."""
    k = stop - begin
    for t in range(-1, dt_offs.size - 1):
        code = last if t < 0 else t
        if code < 0 or (t >= 0 and t == last):
            continue
        a = dt_offs[code]
        if dt_offs[code + 1] - a != k:
            continue
        same = True
        for i in range(k):
            if buf[begin + i] != dt_text[a + i]:
                same = False
                break
        if same:
            return code
    return -1


@njit(**KERNEL)
def scan_meta(
    buf, dt_text, dt_offs, dt_size, keys, names, rows, dims, table, out
):  # pragma: no cover - compiled
    """Reads the children of a ``meta.json`` text (see the module) into ``rows[i]`` (kind, flags,
    dtype code, shape id, bytes, itemsize), the raw key bytes into ``keys`` (NUL after each), the
    key bytes with ``.memmap`` or ``/`` into ``names`` and each distinct shape into ``dims[id]``
    (its ndim in the last column; ``table``: the hash slots). ``out``: ``[ok, children, keys bytes,
    names bytes, shapes, fields]``, ``fields`` the offset of the first key whose value is not an
    object (-1: none); ``ok`` 0 for a text out of the layout or a buffer too small."""
    end = buf.size
    cap = dims.shape[1] - 1
    mask = table.size - 1
    if out.size < 6 or cap < 0 or rows.shape[1] < 6:
        return
    for i in range(table.size):
        table[i] = -1
    for i in range(out.size):
        out[i] = 0
    out[5] = -1
    fields = -1
    n = nk = nn = nshape = hashed = 0
    last = -1
    pstart = plen = prow = 0  # the text of the last leaf parsed, and its row
    pos = _ws(buf, 0, end)
    if pos >= end or buf[pos] != 123:
        return
    pos = _ws(buf, pos + 1, end)
    if pos < end and buf[pos] == 125:  # {}
        if _ws(buf, pos + 1, end) != end:
            return
        out[0] = 1
        return
    while True:
        kstart = pos
        kend, flags = _key(buf, pos, end, _UNSAFE, _HEX, _ESCAPES)
        if kend < 0:
            return
        pos = _colon(buf, kend + 1, end)
        if pos < 0 or pos >= end:
            return
        if buf[pos] != 123:  # the level's own fields: Python's
            fields = kstart
            break
        vstart = pos  # the value's '{'
        pos = _ws(buf, pos + 1, end)
        kbegin = kstart + 1
        klen = kend - kbegin
        if klen == 0 or (klen <= 2 and buf[kbegin] == 46 and buf[kend - 1] == 46):
            flags |= 2  # "", "." and ".." are encoded
        if n >= rows.shape[0] or nk + klen + 1 > keys.size or nn + klen + 8 > names.size:
            return
        for i in range(klen):
            keys[nk + i] = buf[kbegin + i]
            names[nn + i] = buf[kbegin + i]
        nk += klen
        keys[nk] = 0
        nk += 1
        nn += klen
        same = plen > 0 and vstart + plen <= end  # a leaf written as the one before (same bytes)
        if same:
            for i in range(plen):
                if buf[vstart + i] != buf[pstart + i]:
                    same = False
                    break
        if same:
            for i in range(6):
                rows[n, i] = rows[prow, i]
            pos = vstart + plen
            for i in range(7):
                names[nn + i] = _MEMMAP[i]
            nn += 7
        else:
            p = _lit(buf, pos, end, _DEVICE)
            if p >= 0:  # a leaf
                p = _colon(buf, p, end)
                if p < 0:
                    return
                q = _lit(buf, p, end, _NULL)
                p = q if q >= 0 else _ascii(buf, p, end)
                p = _comma(buf, p, end)
                p = _colon(buf, _lit(buf, p, end, _SHAPE_KEY), end)
                if p < 0 or p >= end or buf[p] != 91:
                    return
                p = _ws(buf, p + 1, end)
                if nshape >= dims.shape[0]:
                    return
                ndim = 0
                if p < end and buf[p] == 93:
                    p += 1
                else:
                    while True:
                        if p >= end or ndim >= cap:
                            return
                        c = buf[p]
                        if c < 48 or c > 57:
                            return
                        value = 0
                        digits = 0
                        while p < end and 48 <= buf[p] <= 57:
                            if digits == 18 or (digits == 1 and value == 0):
                                return  # over 18 digits, or a leading zero
                            value = value * 10 + (buf[p] - 48)
                            digits += 1
                            p += 1
                        dims[nshape, ndim] = value
                        ndim += 1
                        p = _ws(buf, p, end)
                        if p >= end:
                            return
                        if buf[p] == 93:
                            p += 1
                            break
                        if buf[p] != 44:
                            return
                        p = _ws(buf, p + 1, end)
                p = _colon(buf, _lit(buf, _comma(buf, p, end), end, _DTYPE_KEY), end)
                q = _ascii(buf, p, end)
                if q < 0:
                    return
                code = _dtype(buf, p + 1, q - 1, dt_text, dt_offs, last)
                if code < 0:
                    return
                last = code
                p = _colon(buf, _lit(buf, _comma(buf, q, end), end, _NESTED_KEY), end)
                p = _ws(buf, _lit(buf, p, end, _FALSE), end)
                if p < 0 or p >= end or buf[p] != 125:
                    return
                pos = p + 1
                itemsize = dt_size[code]
                bound = itemsize
                nbytes = itemsize
                for d in range(ndim):
                    s = dims[nshape, d]
                    nbytes *= s
                    if s > 1:
                        if bound > MAX_NBYTES // s:
                            return
                        bound *= s
                dims[nshape, cap] = ndim
                sid = -1
                if hashed < table.size // 2:  # the shape's id: an equal shape seen before, or a new one
                    h = ndim * 1000003
                    for d in range(ndim):
                        h = (h * 31 + dims[nshape, d]) & 0x7FFFFFFFFFFF
                    h &= mask
                    while table[h] >= 0:
                        other = table[h]
                        same = dims[other, cap] == ndim
                        if same:
                            for d in range(ndim):
                                if dims[other, d] != dims[nshape, d]:
                                    same = False
                                    break
                        if same:
                            sid = other
                            break
                        h = (h + 1) & mask
                    if sid < 0:
                        table[h] = nshape
                        hashed += 1
                if sid < 0:
                    sid = nshape
                    nshape += 1
                rows[n, 0] = 0
                rows[n, 2] = code
                rows[n, 3] = sid
                rows[n, 4] = nbytes
                rows[n, 5] = itemsize
                for i in range(7):
                    names[nn + i] = _MEMMAP[i]
                nn += 7
                pstart, plen, prow = vstart, pos - vstart, n
            else:  # a sub-level
                p = _ascii(buf, _colon(buf, _lit(buf, pos, end, _TYPE_KEY), end), end)
                p = _ws(buf, p, end)
                if p < 0 or p >= end or buf[p] != 125:
                    return
                pos = p + 1
                rows[n, 0] = 1
                rows[n, 2] = -1
                rows[n, 3] = -1
                rows[n, 4] = -1
                rows[n, 5] = 0
                names[nn] = 47  # "/"
                nn += 1
        rows[n, 1] = flags
        names[nn] = 0
        nn += 1
        n += 1
        pos = _ws(buf, pos, end)
        if pos >= end:
            return
        if buf[pos] == 125:  # "}": the end of the text
            if _ws(buf, pos + 1, end) != end:
                return
            break
        if buf[pos] != 44:
            return
        pos = _ws(buf, pos + 1, end)
    out[0] = 1
    out[1] = n
    out[2] = nk
    out[3] = nn
    out[4] = nshape
    out[5] = fields


_TABLE: list[Any] = []  # (dtype names as one buffer, offsets, itemsizes, names as objects)


def _dtypes() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dtype table the kernel matches names against (made once)."""
    if not _TABLE:
        table = dtype_table()
        names = list(table)
        raw = [n.encode("ascii") for n in names]
        text = np.frombuffer(b"".join(raw), np.uint8)
        text.flags.writeable = False
        offs = np.zeros(len(raw) + 1, np.int64)
        offs[1:] = np.cumsum([len(r) for r in raw])
        sizes = np.array([table[n].itemsize for n in names], np.int64)
        objs = np.empty(len(names), object)
        objs[:] = names
        _TABLE.extend((text, offs, sizes, objs))
    return _TABLE[0], _TABLE[1], _TABLE[2], _TABLE[3]


def _split(buf: np.ndarray, used: int) -> list[str]:
    """The NUL-terminated UTF-8 texts in ``buf[:used]`` (raises UnicodeDecodeError)."""
    return buf[: used - 1].tobytes().decode("utf-8").split("\0") if used else []


def scan_level(data: bytes, prefix: str, has_meta: Callable[[str], bool]) -> PlainLevel | None:
    """The :class:`~tdz_numba.tdz.plainlevel.PlainLevel` of the ``meta.json`` bytes ``data`` of
    the level at ``prefix`` by :func:`scan_meta`: what ``plain_td_level(parse_meta(data, ...),
    prefix, has_meta)`` gives when that is ``(True, level)``, or None, where the caller takes that
    path (a text out of the layout, a level that is not plain, anything it would refuse)."""
    size = len(data)
    buf = np.frombuffer(data, np.uint8)
    if buf.flags.writeable:  # one compiled signature for every text (bytes are read-only)
        buf = buf.view()
        buf.flags.writeable = False
    dt_text, dt_offs, dt_size, dt_names = _dtypes()
    nrows = size // 14 + 2  # a child takes at least 14 bytes ('"":{"type":""},')
    keys = np.empty(size + 1, np.uint8)
    names = np.empty(size + 8, np.uint8)
    rows = np.empty((nrows, 6), np.int64)
    dims = np.empty((size // 56 + 2, MAX_DIMS + 1), np.int64)  # a leaf: at least 58 bytes
    table = np.empty(_HASH_SLOTS, np.int64)
    out = np.empty(6, np.int64)
    scan_meta(buf, dt_text, dt_offs, dt_size, keys, names, rows, dims, table, out)
    if not out[0]:
        return None
    n, nk, nn, nshape, at = out[1:].tolist()
    try:
        fields = parse_meta(b"{" + data[at:], "") if at >= 0 else {}
        keys_of = _split(keys, nk)
        names_of = _split(names, nn)
    except (BadArchiveError, UnicodeDecodeError):
        return None
    if type(fields) is not dict:
        return None
    for key, value in fields.items():
        if key not in RESERVED_FIELDS or type(value) is dict:
            return None  # not plain, or children after the fields: the parsing path
    if not td_fields_ok(fields) or fields.get("_type") == NON_TENSOR_DATA_TYPE:
        return None
    cols = rows[:n]
    flagged = np.flatnonzero(cols[:, _FLAGS]).tolist() if n else []
    encoded = _ENCODED
    for i in flagged:
        key = keys_of[i]
        if cols[i, _FLAGS] & ESCAPED:
            try:
                key = keys_of[i] = parse_meta(b'"' + key.encode("utf-8") + b'"', "")
            except BadArchiveError:
                return None
        fname = encoded.get(key) or encode_key(key)
        names_of[i] = fname + (".memmap" if cols[i, _KIND] == 0 else "/")
    seen = set(keys_of)
    if (
        len(seen) != n
        or not seen.isdisjoint(fields)
        or not seen.isdisjoint(("_class", "_type", "_format_version"))
    ):
        return None  # a key twice (JSON keeps its last value), or a child named like a field read above
    lvl = PlainLevel()
    lvl.fields = fields
    shapes = np.empty(nshape, object)
    strides = np.empty(nshape, object)
    for s in range(nshape):
        ndim = int(dims[s, MAX_DIMS])
        shape = tuple(dims[s, :ndim].tolist())
        shapes[s] = shape
        strides[s] = contiguous_strides(shape)
    kinds = cols[:, _KIND]
    leaf = kinds == 0
    if leaf.all():
        lvl.names = names_of
        lvl.nbytes = cols[:, _NBYTES].tolist()
        lvl.itemsize = cols[:, _ITEMSIZE].tolist()
        codes, sids = cols[:, _CODE], cols[:, _SHAPE]
        lvl.items = list(
            zip(
                keys_of,
                names_of,
                lvl.nbytes,
                dt_names[codes].tolist(),
                shapes[sids].tolist(),
                strides[sids].tolist(),
            )
        )
        return lvl
    for i in np.flatnonzero(~leaf).tolist():
        if not has_meta(prefix + names_of[i] + "meta.json"):
            return None
    sel = np.flatnonzero(leaf)
    lvl.names = [names_of[i] for i in sel.tolist()]
    lvl.nbytes = cols[sel, _NBYTES].tolist()
    lvl.itemsize = cols[sel, _ITEMSIZE].tolist()
    lvl.subs = [names_of[i] for i in np.flatnonzero(~leaf).tolist()]
    items = lvl.items
    nbytes_of, codes_of, sids_of = (
        cols[:, _NBYTES].tolist(),
        cols[:, _CODE].tolist(),
        cols[:, _SHAPE].tolist(),
    )
    for i, key in enumerate(keys_of):
        if sids_of[i] < 0:
            items.append((key, names_of[i], -1, None, (), ()))
        else:
            s = sids_of[i]
            items.append((key, names_of[i], nbytes_of[i], dt_names[codes_of[i]], shapes[s], strides[s]))
    return lvl
