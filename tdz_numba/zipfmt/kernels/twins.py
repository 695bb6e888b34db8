"""Kernel twins without Numba: the CRC and layout kernels in plain Python, numpy and zlib-ng
(the central-directory kernels' twin is :mod:`tdz_numba.zipfmt.kernels.central_twin`).

A fresh environment with an empty Numba cache would compile the kernels of
:mod:`tdz_numba.zipfmt.kernels.crc` (LLVM: seconds) on its first save or load.
:mod:`tdz_numba.zipfmt.kernels.dispatch` sends small work here instead; every function
returns exactly what its kernel returns (the same arrays, the same status
codes, filled in the same order), so archives are byte-identical and a
hostile file is refused with the same :class:`~tdz_numba.TdzError` message on
either path. ``tests/test_firstuse.py`` checks each twin against its kernel.

No module here imports Numba.

Examples
--------
>>> import numpy as np, zlib
>>> from tdz_numba.zipfmt.kernels import twins as pykernels
>>> data = np.frombuffer(b"hello world", dtype=np.uint8)
>>> crc = pykernels.crc32_spans(np.array([data.ctypes.data], np.int64),
...                             np.array([data.size], np.int64), 1 << 20)[0]
>>> int(crc) == zlib.crc32(b"hello world")
True
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency
    from zlib import crc32 as _crc32

__all__ = [
    "crc32_combine",
    "crc32_zeros",
    "crc32_spans",
    "plan_layout",
]

_POLY = 0xEDB88320
#: Spans totalling at least this many bytes are hashed in a thread pool (zlib-ng releases the GIL).
POOL_BYTES = 32 << 20


# --------------------------------------------------------------------------
# CRC-32
# --------------------------------------------------------------------------
def _multmodp(a: int, b: int) -> int:
    """Product of two polynomials modulo the CRC-32 polynomial (reflected)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = []
    p = 1 << 30  # x ** 1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x ** (2 ** k) modulo the polynomial


def _x8nmodp(n: int) -> int:
    """x ** (8 * n) modulo the CRC-32 polynomial."""
    p = 1 << 31
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (as the kernel)."""
    crc1, crc2, len2 = int(crc1) & 0xFFFFFFFF, int(crc2) & 0xFFFFFFFF, int(len2)
    if len2 <= 0:
        return crc1
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def crc32_zeros(n: int) -> int:
    """CRC-32 of ``n`` zero bytes without touching memory: zeros only shift the
    initial register, ``crc = 0xFFFFFFFF * x ** (8 n) ^ 0xFFFFFFFF`` (O(log n))."""
    n = int(n)
    if n <= 0:
        return 0
    return _multmodp(_x8nmodp(n), 0xFFFFFFFF) ^ 0xFFFFFFFF


def _span_crc(addr: int, length: int) -> int:
    if length <= 0:
        return 0
    return _crc32(memoryview((ctypes.c_char * length).from_address(addr)))  # type: ignore[operator]


def _pieces_crc(span: tuple[int, int, int]) -> int:
    return _span_crc(span[0], span[1])


def crc32_spans(addrs, lengths, chunk: int, num_threads: int | None = None) -> np.ndarray:
    """CRC-32 of each memory span ``[addrs[i], addrs[i] + lengths[i])`` (uint32 array).

    Small totals are hashed in this thread; from :data:`POOL_BYTES` on, spans are
    cut into ``chunk``-aligned pieces of at least 8 MiB hashed in a thread pool
    and combined in order.
    """
    a = np.asarray(addrs, np.int64).tolist()
    n_ = np.asarray(lengths, np.int64).tolist()
    out = np.zeros(len(a), np.uint32)
    total = sum(max(x, 0) for x in n_)
    threads = num_threads if num_threads is not None else (os.cpu_count() or 1)
    if total < POOL_BYTES or threads < 2:
        for i, (addr, length) in enumerate(zip(a, n_)):
            out[i] = _span_crc(addr, length)
        return out
    piece = max(int(chunk), 1) * max(1, (8 << 20) // max(int(chunk), 1))
    jobs: list[tuple[int, int, int]] = []
    for i, (addr, length) in enumerate(zip(a, n_)):
        for off in range(0, max(length, 0), piece):
            jobs.append((addr + off, min(piece, length - off), i))
    with ThreadPoolExecutor(min(threads, len(jobs) or 1), thread_name_prefix="tdz-crc") as pool:
        crcs = list(pool.map(_pieces_crc, jobs))
    acc = [0] * len(a)
    for (_, length, i), c in zip(jobs, crcs):
        acc[i] = crc32_combine(acc[i], c, length)
    out[:] = acc
    return out


# --------------------------------------------------------------------------
# Layout plan
# --------------------------------------------------------------------------
def plan_layout(header_len, data_size, align, room) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Offsets of every local header and payload: what :func:`tdz_numba.zipfmt.kernels.crc.plan_layout` returns."""
    hl = np.asarray(header_len, np.int64)
    ds = np.asarray(data_size, np.int64)
    al = np.asarray(align, np.int64)
    n = hl.size
    pad = np.full(n, -1, np.int64)
    if not bool((al > 1).any()):  # no padding: records back to back
        ends = np.cumsum(hl + ds)
        hoff = np.concatenate(([0], ends[:-1])).astype(np.int64) if n else np.empty(0, np.int64)
        return hoff, pad, hoff + hl, int(ends[-1]) if n else 0
    hoff_l = [0] * n
    pay_l = [0] * n
    pad_l = [-1] * n
    pos = 0
    for i, (h, d, a, r) in enumerate(zip(hl.tolist(), ds.tolist(), al.tolist(), np.asarray(room).tolist())):
        if a > 1:
            need = (a - (pos + h) % a) % a
            if need > r:
                pos += need - r
        hoff_l[i] = pos
        base = pos + h
        if a > 1:
            pad_l[i] = (a - base % a) % a
            base += pad_l[i]
        pay_l[i] = base
        pos = base + d
    return np.array(hoff_l, np.int64), np.array(pad_l, np.int64), np.array(pay_l, np.int64), pos
