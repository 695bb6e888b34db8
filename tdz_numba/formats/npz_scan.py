"""The Numba twin of the header gather of :func:`~tdz_numba.formats.numpy_fmt._bulk_npz`: every
``.npz`` member's ``.npy`` header checked and grouped by its bytes, in one compiled pass.

``np.savez`` writes each array as a STORED member that starts with a version-1 ``.npy``
header (magic, version, a 2-byte length, the header text); a file of many arrays holds few
distinct headers (one per dtype and shape). :func:`group_headers` reads each member's
header where the zip index says its payload starts, checks what the Python gather checks
(room for the fixed part, inside the file, the magic, version 1, a length of at most the
bulk limit that fits the member) and numbers the distinct headers in the order they first
appear (a hash table of the header bytes, every match confirmed byte by byte). It reads
only ``buf`` inside the bounds it checks, and allocates only its hash table.

Examples
--------
>>> import numpy as np
>>> from tdz_numba.formats.npz_scan import group
>>> h = b"\\x93NUMPY\\x01\\x00\\x06\\x00{'a':}"
>>> buf = np.frombuffer(h + b"xx" + h + h, np.uint8)
>>> which, reps, hlen = group(buf, np.array([0, 18, 34]), np.array([16, 16, 16]), 1024)
>>> which.tolist(), reps.tolist(), hlen.tolist()
([0, 0, 0], [0], [6, 6, 6])
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..jit.presets import KERNEL

__all__ = ["group_headers", "group"]

_FAIL = -1  # a member the bulk path does not read: the caller falls back


@njit(**KERNEL)
def _equal(buf, a, b, length):  # pragma: no cover - compiled
    """Whether ``buf[a:a+length]`` and ``buf[b:b+length]`` hold the same bytes (one branch-free
    pass that LLVM vectorizes: ~13x a byte loop that stops at the first difference)."""
    x = buf[a : a + length]
    y = buf[b : b + length]
    d = 0
    for k in range(length):
        d |= x[k] ^ y[k]
    return d == 0


@njit(**KERNEL)
def _hash(buf, p, length):  # pragma: no cover - compiled
    """A hash of ``buf[p:p+length]``: a position-weighted sum (vectorized), then mixed
    (uint64 arithmetic wraps). Equal bytes, equal hash; a collision costs a compare."""
    x = buf[p : p + length]
    h = np.uint64(length)
    for k in range(length):
        h += np.uint64(x[k]) * (np.uint64(k + 1) * np.uint64(0x9E3779B97F4A7C15))
    h ^= h >> np.uint64(29)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(32)
    return h


@njit(**KERNEL)
def group_headers(buf, po, size, max_hlen, hlen, which, reps):  # pragma: no cover - compiled
    """Checks and groups the ``.npy`` header of every member (payload at ``po[i]``, ``size[i]``
    bytes): fills ``hlen`` (each header text's length), ``which`` (each member's group) and
    ``reps`` (each group's first member); the number of groups, or -1 where a member is not a
    version-1 ``.npy`` array inside the file with a header text of at most ``max_hlen`` bytes."""
    n = po.size
    total = buf.size
    cap = 16
    while cap < 2 * n:
        cap *= 2
    table = np.full(cap, -1, np.int64)
    groups = 0
    prev = -1
    for i in range(n):
        p = po[i]
        s = size[i]
        if s < 10 or p < 0 or p > total - s:
            return _FAIL
        if (
            buf[p] != 0x93
            or buf[p + 1] != 0x4E  # N
            or buf[p + 2] != 0x55  # U
            or buf[p + 3] != 0x4D  # M
            or buf[p + 4] != 0x50  # P
            or buf[p + 5] != 0x59  # Y
            or buf[p + 6] != 1
        ):
            return _FAIL
        length = np.int64(buf[p + 8]) | (np.int64(buf[p + 9]) << 8)
        if length > max_hlen or 10 + length > s:
            return _FAIL
        hlen[i] = length
        step = 10 + length
        if prev >= 0:  # the previous member's header again (a model's many equal arrays)
            r = reps[prev]
            if hlen[r] == length and _equal(buf, po[r], p, step):
                which[i] = prev
                continue
        slot = np.int64(_hash(buf, p, step) & np.uint64(cap - 1))
        while True:
            g = table[slot]
            if g < 0:
                table[slot] = groups
                reps[groups] = i
                g = groups
                groups += 1
                break
            r = reps[g]
            if hlen[r] == length and _equal(buf, po[r], p, step):
                break
            slot = (slot + 1) & (cap - 1)
        which[i] = g
        prev = g
    return groups


def group(
    buf: np.ndarray, po: np.ndarray, size: np.ndarray, max_hlen: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(which, reps, hlen)`` of :func:`group_headers` (``reps`` cut to the groups), or None
    where a member is not read by the bulk path."""
    n = po.size
    po = np.ascontiguousarray(po, np.int64)
    size = np.ascontiguousarray(size, np.int64)
    hlen = np.empty(n, np.int64)
    which = np.empty(n, np.int64)
    reps = np.empty(n, np.int64)
    groups = group_headers(buf, po, size, np.int64(max_hlen), hlen, which, reps)
    if groups < 0:
        return None
    return which, reps[:groups], hlen
