"""Numba kernels: CRC-32 and the archive layout plan (the central-directory kernels are in
:mod:`tdz_numba.zipfmt.kernels.central`).

Record layouts, field offsets, index columns and status codes come from
:mod:`tdz_numba.zipfmt.records` (frozen into the compiled code as constants: the zip
format does not change, so the on-disk cache keyed on this file stays valid).

Kernels take arrays and integers and return arrays or status codes. They do
no I/O, build no strings and touch no Python objects; the Python modules that
call them validate input first and turn status codes into exceptions.

Memory is passed as integer addresses with byte counts (``addrs``,
``lengths``), so one kernel call covers slices of a memory map, torch tensors
and numpy arrays alike, read-only or not. The caller keeps the owners alive.

Examples
--------
>>> import numpy as np, zlib
>>> from tdz_numba.zipfmt.kernels import crc as kernels
>>> data = np.frombuffer(b"hello world", dtype=np.uint8)
>>> crc = kernels.crc32_spans(np.array([data.ctypes.data], np.int64),
...                           np.array([data.size], np.int64), 1 << 20)[0]
>>> int(crc) == zlib.crc32(b"hello world")
True
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from ...jit.presets import HAVE_ZNG_CRC, KERNEL, PARALLEL, u8_pointer, zng_crc32_z

__all__ = [
    "crc32_combine",
    "crc32_zeros",
    "crc32_spans",
    "table_crc32",
    "plan_layout",
]

_POLY = np.uint32(0xEDB88320)


# --------------------------------------------------------------------------
# CRC-32
# --------------------------------------------------------------------------
@njit(**KERNEL)
def _multmodp(a, b):
    """Product of two polynomials modulo the CRC-32 polynomial (reflected)."""
    m = np.uint32(1 << 31)
    p = np.uint32(0)
    a = np.uint32(a)
    b = np.uint32(b)
    while True:
        if a & m:
            p ^= b
            if (a & (m - np.uint32(1))) == 0:
                break
        m >>= np.uint32(1)
        if b & np.uint32(1):
            b = (b >> np.uint32(1)) ^ _POLY
        else:
            b >>= np.uint32(1)
    return p


@njit(**KERNEL)
def _x2nmodp(n, k):
    """x ** (n * 2 ** k) modulo the CRC-32 polynomial."""
    p = np.uint32(1 << 31)
    sq = np.uint32(1 << 30)  # x ** 1
    for _ in range(k):
        sq = _multmodp(sq, sq)
    while n:
        if n & 1:
            p = _multmodp(sq, p)
        n >>= 1
        sq = _multmodp(sq, sq)
    return p


@njit(**KERNEL)
def crc32_combine(crc1, crc2, len2):
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``.

    Multiplies ``crc1`` by ``x ** (8 * len2)`` in GF(2)[x] modulo the CRC
    polynomial, as zlib's ``crc32_combine`` does: O(log len2).
    """
    if len2 <= 0:
        return np.uint32(crc1)
    return _multmodp(_x2nmodp(len2, 3), np.uint32(crc1)) ^ np.uint32(crc2)


@njit(**KERNEL)
def crc32_zeros(n):
    """CRC-32 of ``n`` zero bytes without touching memory: O(log n) combines."""
    result = np.uint32(0)
    block = np.uint32(0xD202EF8D)  # crc32(b"\\0")
    block_len = 1
    while n > 0:
        if n & 1:
            result = crc32_combine(result, block, block_len)
        block = crc32_combine(block, block, block_len)
        block_len *= 2
        n >>= 1
    return result


@njit(**KERNEL)
def _crc_table():
    table = np.empty(256, np.uint32)
    for i in range(256):
        c = np.uint32(i)
        for _ in range(8):
            if c & np.uint32(1):
                c = (c >> np.uint32(1)) ^ _POLY
            else:
                c >>= np.uint32(1)
        table[i] = c
    return table


@njit(**KERNEL)
def table_crc32(data, crc, table):
    """Byte-wise table CRC-32 of a uint8 array, continuing from ``crc``.

    The fallback when zlib-ng's ``zng_crc32_z`` symbol is missing.
    """
    mask = np.uint32(0xFFFFFFFF)
    c = np.uint32(crc) ^ mask
    for i in range(data.size):
        c = table[np.intp((c ^ np.uint32(data[i])) & np.uint32(0xFF))] ^ (c >> np.uint32(8))
    return np.uint32(c ^ mask)


@njit(**KERNEL)
def _span_crc(addr, length, table):
    if HAVE_ZNG_CRC:
        return zng_crc32_z(np.uint32(0), addr, length)
    return table_crc32(carray(u8_pointer(addr), length), np.uint32(0), table)


@njit(**KERNEL)
def _chunk_plan(lengths, chunk):
    """Start index of each span's chunks in a flat chunk list (len n + 1)."""
    n = lengths.size
    first = np.zeros(n + 1, np.int64)
    for i in range(n):
        k = (lengths[i] + chunk - 1) // chunk
        first[i + 1] = first[i] + k
    return first


@njit(**KERNEL)
def _fold_chunks(crcs, first, lengths, chunk):
    """Combines each span's chunk CRCs into the span's CRC, in order (a span of one
    chunk is that chunk's CRC: no combine, ~1 us each)."""
    n = lengths.size
    out = np.zeros(n, np.uint32)
    for i in range(n):
        if first[i + 1] - first[i] == 1:
            out[i] = crcs[first[i]]
            continue
        c = np.uint32(0)
        remaining = lengths[i]
        for j in range(first[i], first[i + 1]):
            size = min(chunk, remaining)
            c = crc32_combine(c, crcs[j], size)
            remaining -= size
        out[i] = c
    return out


@njit(**PARALLEL)
def crc32_spans(addrs, lengths, chunk):
    """CRC-32 of each memory span ``[addrs[i], addrs[i] + lengths[i])``.

    Every span is cut into ``chunk``-byte pieces hashed in parallel (across and
    within spans) by zlib-ng, then the pieces are combined in order.
    """
    first = _chunk_plan(lengths, chunk)
    total = first[-1]
    owner = np.empty(total, np.int64)
    for i in range(lengths.size):
        for j in range(first[i], first[i + 1]):
            owner[j] = i
    crcs = np.zeros(total, np.uint32)
    table = _crc_table()
    for j in prange(total):
        i = owner[j]
        offset = (j - first[i]) * chunk
        size = min(chunk, lengths[i] - offset)
        crcs[j] = _span_crc(addrs[i] + offset, size, table)
    return _fold_chunks(crcs, first, lengths, chunk)


# --------------------------------------------------------------------------
# Layout plan
# --------------------------------------------------------------------------
@njit(**KERNEL)
def plan_layout(header_len, data_size, align, room):
    """Offsets of every local header and payload of an archive, in one pass.

    The record lengths and zip64 decisions come from :mod:`tdz_numba.zipfmt.records`
    (through :func:`tdz_numba.zipfmt.layout.plan`); this kernel only places records
    one after the other and pads aligned payloads.

    Parameters
    ----------
    header_len : int64 array
        Bytes of each local header without its padding bytes
        (:func:`tdz_numba.zipfmt.packers.local_header_len`).
    data_size : int64 array
        Stored (compressed) payload size per entry.
    align : int64 array
        Payload alignment per entry: > 1 pads the payload to a multiple of it
        (the padding block's header is counted in ``header_len``); 0 or 1:
        no padding block.
    room : int64 array
        The most padding bytes each entry's local extra field can still hold
        (a zip extra field is at most 65,535 bytes). When an alignment needs
        more (a 64 KiB alignment can ask for up to 65,535 bytes), the local
        header starts that much later: a gap of zeros after the previous
        entry, which zip readers skip (they seek to the central directory's
        header offsets).

    Returns
    -------
    header_offset : int64 array
    pad : int64 array
        Padding bytes of aligned entries; -1 for entries without a padding block.
    payload_offset : int64 array
    data_end : int
        Offset after the last payload: where the central directory starts.
    """
    n = header_len.size
    header_offset = np.empty(n, np.int64)
    pad = np.full(n, -1, np.int64)
    payload = np.empty(n, np.int64)
    pos = np.int64(0)
    for i in range(n):
        a = align[i]
        if a > 1:
            need = (a - (pos + header_len[i]) % a) % a
            if need > room[i]:
                pos += need - room[i]  # the gap: the header starts later, the padding shrinks
        header_offset[i] = pos
        base = pos + header_len[i]
        if a > 1:
            pad[i] = (a - base % a) % a
            base += pad[i]
        payload[i] = base
        pos = base + data_size[i]
    return header_offset, pad, payload, pos
