"""Numba kernels: CRC-32, the archive layout plan, the central-directory index.

Kernels take arrays and integers and return arrays or status codes. They do
no I/O, build no strings and touch no Python objects; the Python modules that
call them validate input first and turn status codes into exceptions.

Memory is passed as integer addresses with byte counts (``addrs``,
``lengths``), so one kernel call covers slices of a memory map, torch tensors
and numpy arrays alike, read-only or not. The caller keeps the owners alive.

Examples
--------
>>> import numpy as np, zlib
>>> from tdz_numba import kernels
>>> data = np.frombuffer(b"hello world", dtype=np.uint8)
>>> crc = kernels.crc32_spans(np.array([data.ctypes.data], np.int64),
...                           np.array([data.size], np.int64), 1 << 20)[0]
>>> int(crc) == zlib.crc32(b"hello world")
True
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from ._jit import HAVE_ZNG_CRC, KERNEL, PARALLEL, u8_pointer, zng_crc32_z

__all__ = [
    "CRC_CHUNK",
    "crc32_combine",
    "crc32_zeros",
    "crc32_spans",
    "table_crc32",
    "plan_layout",
    "parse_central_directory",
    "IndexStatus",
]

#: Bytes hashed per parallel work item: large enough to amortize the call,
#: small enough to split one large entry across all cores.
CRC_CHUNK = 1 << 20

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
    """Combines each span's chunk CRCs into the span's CRC, in order."""
    n = lengths.size
    out = np.zeros(n, np.uint32)
    for i in range(n):
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
#: zipfile's (and so tensordict's) threshold for zip64 fields: 2 GiB - 1.
ZIP64_LIMIT = (1 << 31) - 1
#: More entries than this need the zip64 end records.
ZIP_COUNT_LIMIT = (1 << 16) - 1
_LOCAL_FIXED = 30
_CENTRAL_FIXED = 46
_ZIP64_LOCAL_EXTRA = 20  # id, size, file size, compressed size
_PAD_HEADER = 4  # id, size of the 0x6474 padding block


@njit(**KERNEL)
def plan_layout(name_len, data_size, align, alignment, start, local_more):
    """Offsets of every record of an archive, in one pass.

    Parameters
    ----------
    name_len, data_size : int64 arrays
        Encoded name length and stored (compressed) payload size per entry.
    align : bool array
        Whether the entry's payload is aligned with a ``0x6474`` padding block.
    alignment : int
        Payload alignment in bytes (64).
    start : int
        Offset of the first local header (0).
    local_more : int64 array
        Bytes of other local extra blocks (the segment table of compressed
        entries), placed first in the extra field.

    Returns
    -------
    header_offset, local_extra_len, pad, payload_offset, central_extra_len : int64 arrays
    central_zip64 : int64 array
        Bit 0: sizes go in the central zip64 extra; bit 1: the header offset does.
    tail : int64 array of 4
        ``cd_offset, cd_size, needs_zip64_end, file_size``.
    """
    n = name_len.size
    header_offset = np.empty(n, np.int64)
    local_extra = np.empty(n, np.int64)
    pad = np.zeros(n, np.int64)
    payload = np.empty(n, np.int64)
    central_extra = np.empty(n, np.int64)
    central_zip64 = np.zeros(n, np.int64)
    pos = start
    cd_size = 0
    for i in range(n):
        header_offset[i] = pos
        extra = _ZIP64_LOCAL_EXTRA + local_more[i]
        if align[i]:
            base = pos + _LOCAL_FIXED + name_len[i] + local_more[i] + _PAD_HEADER + _ZIP64_LOCAL_EXTRA
            pad[i] = (alignment - base % alignment) % alignment
            extra += _PAD_HEADER + pad[i]
        local_extra[i] = extra
        payload[i] = pos + _LOCAL_FIXED + name_len[i] + extra
        pos = payload[i] + data_size[i]
        cextra = 0
        fields = 0
        if data_size[i] > ZIP64_LIMIT:
            central_zip64[i] |= 1
            fields += 2
        if header_offset[i] > ZIP64_LIMIT:
            central_zip64[i] |= 2
            fields += 1
        if fields:
            cextra += 4 + 8 * fields
        if align[i]:
            cextra += _PAD_HEADER + pad[i]
        central_extra[i] = cextra
        cd_size += _CENTRAL_FIXED + name_len[i] + cextra
    tail = np.empty(4, np.int64)
    tail[0] = pos
    tail[1] = cd_size
    zip64_end = n > ZIP_COUNT_LIMIT or pos > ZIP64_LIMIT or cd_size > ZIP64_LIMIT
    tail[2] = 1 if zip64_end else 0
    tail[3] = pos + cd_size + (56 + 20 if zip64_end else 0) + 22
    return header_offset, local_extra, pad, payload, central_extra, central_zip64, tail


# --------------------------------------------------------------------------
# Central directory index
# --------------------------------------------------------------------------
class IndexStatus:
    """Status codes of :func:`parse_central_directory` (0 is success)."""

    OK = 0
    CENTRAL_SIGNATURE = 1  # a central record does not start with PK\1\2
    CENTRAL_OVERRUN = 2  # a central record runs past the central directory
    ZIP64_EXTRA = 3  # a 0xFFFFFFFF field without its zip64 extra value
    HEADER_PAST_END = 4  # a local header offset outside the data area
    LOCAL_SIGNATURE = 5  # the local header does not start with PK\3\4
    NAME_MISMATCH = 6  # local and central names differ
    PAYLOAD_PAST_END = 7  # the payload runs into the central directory
    OVERLAP = 8  # two entries' records overlap
    COUNT = 9  # the central directory holds another number of records than the end record says


@njit(**KERNEL)
def _u16(buf, p):
    return np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)


@njit(**KERNEL)
def _u32(buf, p):
    return _u16(buf, p) | (_u16(buf, p + 2) << 16)


@njit(**KERNEL)
def _u64(buf, p):
    return _u32(buf, p) | (_u32(buf, p + 4) << 32)


@njit(**KERNEL)
def parse_central_directory(buf, cd_offset, cd_size, count, check_local):
    """Parses every central record and its local header into arrays.

    Parameters
    ----------
    buf : uint8 array
        The whole archive (usually its memory map).
    cd_offset, cd_size, count : int
        From the end-of-central-directory record (zip64 where present).
    check_local : bool
        Also read and check every local header (signature, name, payload
        bounds, exact overlaps). Without it (a lazy open touches no payload
        page), payload offsets and local extra lengths are -1, to be resolved
        per entry on access, and overlaps are checked on the smallest extent
        a record can have (its fixed header, name and data).

    Returns
    -------
    fields : int64 array (count, 13)
        Per entry: flags, method, crc, compressed size, size, header offset,
        name offset (in ``buf``), name length, payload offset, central record
        offset, dos time, dos date, local extra length.
    status : int64 array of 4
        ``code, entry index, expected, found`` (see :class:`IndexStatus`).
    """
    f = np.zeros((count, 13), np.int64)
    status = np.zeros(4, np.int64)
    end = cd_offset + cd_size
    p = cd_offset
    for i in range(count):
        if p + 46 > end:
            status[0], status[1], status[2], status[3] = 9, i, count, i
            return f, status
        if _u32(buf, p) != 0x02014B50:
            status[0], status[1], status[2], status[3] = 1, i, 0x02014B50, _u32(buf, p)
            return f, status
        flags = _u16(buf, p + 8)
        method = _u16(buf, p + 10)
        dtime = _u16(buf, p + 12)
        ddate = _u16(buf, p + 14)
        crc = _u32(buf, p + 16)
        csize = _u32(buf, p + 20)
        usize = _u32(buf, p + 24)
        nlen = _u16(buf, p + 28)
        elen = _u16(buf, p + 30)
        clen = _u16(buf, p + 32)
        hoff = _u32(buf, p + 42)
        rec_end = p + 46 + nlen + elen + clen
        f[i, 0] = flags  # name fields first: an error below can then name the entry
        f[i, 6] = p + 46
        f[i, 7] = nlen
        if rec_end > end:
            status[0], status[1], status[2], status[3] = 2, i, end, rec_end
            return f, status
        # zip64 extra: values appear only for the fields set to 0xFFFFFFFF
        need = 0
        if usize == 0xFFFFFFFF:
            need += 1
        if csize == 0xFFFFFFFF:
            need += 1
        if hoff == 0xFFFFFFFF:
            need += 1
        if need:
            q = p + 46 + nlen
            qend = q + elen
            found = False
            while q + 4 <= qend:
                tag = _u16(buf, q)
                size = _u16(buf, q + 2)
                if q + 4 + size > qend:
                    break
                if tag == 1:
                    if size < 8 * need:
                        break
                    r = q + 4
                    if usize == 0xFFFFFFFF:
                        usize = _u64(buf, r)
                        r += 8
                    if csize == 0xFFFFFFFF:
                        csize = _u64(buf, r)
                        r += 8
                    if hoff == 0xFFFFFFFF:
                        hoff = _u64(buf, r)
                    found = True
                    break
                q += 4 + size
            if not found:
                status[0], status[1], status[2], status[3] = 3, i, need, 0
                return f, status
        if hoff < 0 or hoff + 30 > cd_offset:
            status[0], status[1], status[2], status[3] = 4, i, cd_offset, hoff
            return f, status
        f[i, 1] = method
        f[i, 2] = crc
        f[i, 3] = csize
        f[i, 4] = usize
        f[i, 5] = hoff
        f[i, 9] = p
        f[i, 10] = dtime
        f[i, 11] = ddate
        p = rec_end
        if not check_local:
            f[i, 8] = -1
            f[i, 12] = -1
            if csize < 0 or hoff + 30 + nlen + csize > cd_offset:
                status[0], status[1], status[2], status[3] = 7, i, cd_offset, hoff + 30 + nlen + csize
                return f, status
            continue
        if _u32(buf, hoff) != 0x04034B50:
            status[0], status[1], status[2], status[3] = 5, i, 0x04034B50, _u32(buf, hoff)
            return f, status
        lnlen = _u16(buf, hoff + 26)
        lelen = _u16(buf, hoff + 28)
        if lnlen != nlen or hoff + 30 + lnlen > cd_offset:
            status[0], status[1], status[2], status[3] = 6, i, nlen, lnlen
            return f, status
        for k in range(nlen):
            if buf[hoff + 30 + k] != buf[f[i, 6] + k]:
                status[0], status[1], status[2], status[3] = 6, i, nlen, k
                return f, status
        payload = hoff + 30 + lnlen + lelen
        if csize < 0 or payload + csize > cd_offset:
            status[0], status[1], status[2], status[3] = 7, i, cd_offset, payload + csize
            return f, status
        f[i, 8] = payload
        f[i, 12] = lelen
    # Records must not overlap: sorted by header offset, each payload ends
    # before the next local header starts.
    order = np.argsort(f[:, 5], kind="mergesort")
    for j in range(count - 1):
        a = order[j]
        b = order[j + 1]
        end_a = f[a, 8] + f[a, 3] if check_local else f[a, 5] + 30 + f[a, 7] + f[a, 3]
        if end_a > f[b, 5]:
            status[0], status[1], status[2], status[3] = 8, a, end_a, f[b, 5]
            return f, status
    if p != end:  # more records than the end record counts
        status[0], status[1], status[2], status[3] = 9, count, count, -1
        return f, status
    return f, status
