"""Storage records of a ``torch.save`` zip found by number, in one compiled pass: the rows of
``<archive>/data/<key>`` for every tensor of a scanned pickle, without a string per tensor.

``torch.save`` names each storage by a decimal key (``"0"``, ``"1"``, ...) and writes it as
the zip entry ``<archive>/data/<key>``. :func:`record_rows` reads the names of the zip's
central directory where the index says they lie, takes those that are the prefix followed
by a number in canonical decimal (the text ``str(int)`` writes) and maps each tensor's key
number (:attr:`~tdz_numba.formats.pickle_scan.Scanned.key_numbers`) to its entry's row. A
name of ASCII bytes decodes to the same text in every zip encoding, so a row found here is
the row :meth:`~tdz_numba.zipfmt.index.ArchiveIndex.row` finds for the key's name; a key
without such an entry (or a key that is not a number) fails the pass, and the caller looks
the names up one by one (which names what is missing).

Examples
--------
>>> import numpy as np
>>> from tdz_numba.formats.pt_records import record_rows
>>> names = b"a/data.pkla/data/1a/data/0a/data/01"
>>> buf = np.frombuffer(names, np.uint8)
>>> off, ln = np.array([0, 10, 18, 26]), np.array([10, 8, 8, 9])
>>> rows = np.empty(3, np.int64)
>>> prefix = np.frombuffer(b"a/data/", np.uint8)
>>> record_rows(buf, off, ln, prefix, np.array([0, 1, 0]), rows), rows.tolist()
(0, [2, 1, 2])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from ..jit.presets import KERNEL

__all__ = ["record_rows", "rows_by_number"]

#: Key numbers may run to this many times the tensors (plus a margin) before the pass declines
#: (its table has one slot per number).
_SPREAD = 4


@njit(**KERNEL)
def record_rows(buf, name_off, name_len, prefix, keynum, rows):  # pragma: no cover - compiled
    """Fills ``rows[t]``: the entry whose name (``buf[name_off[i]:][:name_len[i]]``) is ``prefix``
    then ``keynum[t]`` in canonical decimal. 0, or 1 when a key is not a number, is out of
    reach of the table, or has no entry."""
    n = keynum.size
    bound = 0
    for t in range(n):
        k = keynum[t]
        if k < 0 or k > _SPREAD * n + 1024:
            return 1
        if k >= bound:
            bound = k + 1
    rowof = np.full(bound, -1, np.int64)
    plen = prefix.size
    total = buf.size
    for i in range(name_off.size):
        length = name_len[i]
        o = name_off[i]
        if length <= plen or length > plen + 18 or o < 0 or o > total - length:
            continue
        head = buf[o : o + plen]
        d = 0
        for k in range(plen):
            d |= head[k] ^ prefix[k]
        if d != 0 or (length > plen + 1 and buf[o + plen] == 0x30):  # (a leading zero)
            continue
        v = np.int64(0)
        for k in range(plen, length):
            c = buf[o + k]
            if c < 0x30 or c > 0x39:
                v = -1
                break
            v = v * 10 + np.int64(c - 0x30)
        if 0 <= v < bound:
            rowof[v] = i  # (the index refuses repeated names: one entry per number)
    for t in range(n):
        r = rowof[keynum[t]]
        if r < 0:
            return 1
        rows[t] = r
    return 0


def rows_by_number(index: Any, prefix: str, key_numbers: np.ndarray | None) -> np.ndarray | None:
    """Each tensor's storage record row in ``index`` (a local
    :class:`~tdz_numba.zipfmt.index.ArchiveIndex`, its names in its mapping), or None where
    the pass does not apply or fails (the caller looks the names up)."""
    buf = getattr(index, "buffer", None)
    if key_numbers is None or getattr(index, "ident", None) is None or buf is None or buf.size != index.size:
        return None
    if not prefix.isascii():
        return None
    table = index.table
    rows = np.empty(key_numbers.size, np.int64)
    status = record_rows(
        buf,
        np.ascontiguousarray(table["name_offset"]),
        np.ascontiguousarray(table["name_len"]),
        np.frombuffer((prefix + "data/").encode("ascii"), np.uint8),
        np.ascontiguousarray(key_numbers, np.int64),
        rows,
    )
    return rows if status == 0 else None
