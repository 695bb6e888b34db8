"""Numba kernels: CRC-32, the archive layout plan, the central-directory index.

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
from .. import records

__all__ = [
    "crc32_combine",
    "crc32_zeros",
    "crc32_spans",
    "table_crc32",
    "plan_layout",
    "parse_central_directory",
    "resolve_local",
    "check_local_headers",
]

#: Bytes hashed per parallel work item: large enough to amortize the call,
#: small enough to split one large entry across all cores.


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


# --------------------------------------------------------------------------
# Central directory index
# --------------------------------------------------------------------------
# Field offsets and column numbers as plain ints (Numba freezes them).
_CD_SIZEOF = int(records.Central.SIZEOF)
_CD_FLAGS = int(records.Central.FLAGS)
_CD_METHOD = int(records.Central.METHOD)
_CD_TIME = int(records.Central.TIME)
_CD_DATE = int(records.Central.DATE)
_CD_CRC = int(records.Central.CRC)
_CD_CSIZE = int(records.Central.CSIZE)
_CD_SIZE = int(records.Central.SIZE)
_CD_NAME_LEN = int(records.Central.NAME_LEN)
_CD_EXTRA_LEN = int(records.Central.EXTRA_LEN)
_CD_COMMENT_LEN = int(records.Central.COMMENT_LEN)
_CD_HEADER_OFFSET = int(records.Central.HEADER_OFFSET)
_LH_SIZEOF = int(records.Local.SIZEOF)
_LH_NAME_LEN = int(records.Local.NAME_LEN)
_LH_EXTRA_LEN = int(records.Local.EXTRA_LEN)
_X_SIZEOF = int(records.Extra.SIZEOF)
_X_LEN = int(records.Extra.LEN)
_ZIP64_ID = records.ZIP64_EXTRA_ID
_LOCAL_SIG = records.LOCAL_SIG
_CENTRAL_SIG = records.CENTRAL_SIG
_STORED = records.STORED
_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1

_NCOLS = len(records.Col)
_FLAGS = int(records.Col.FLAGS)
_METHOD = int(records.Col.METHOD)
_CRC = int(records.Col.CRC)
_CSIZE = int(records.Col.CSIZE)
_SIZE = int(records.Col.SIZE)
_HOFF = int(records.Col.HEADER_OFFSET)
_NOFF = int(records.Col.NAME_OFFSET)
_NLEN = int(records.Col.NAME_LEN)
_PAYLOAD = int(records.Col.PAYLOAD_OFFSET)
_COFF = int(records.Col.CENTRAL_OFFSET)
_TIME = int(records.Col.DOS_TIME)
_DATE = int(records.Col.DOS_DATE)
_LEXTRA = int(records.Col.LOCAL_EXTRA_LEN)
_NEXT = int(records.Col.NEXT_OFFSET)

_S = records.Status
_OK = int(_S.OK)
_CENTRAL_SIGNATURE = int(_S.CENTRAL_SIGNATURE)
_CENTRAL_OVERRUN = int(_S.CENTRAL_OVERRUN)
_ZIP64_EXTRA = int(_S.ZIP64_EXTRA)
_HEADER_PAST_END = int(_S.HEADER_PAST_END)
_LOCAL_SIGNATURE = int(_S.LOCAL_SIGNATURE)
_NAME_MISMATCH = int(_S.NAME_MISMATCH)
_PAYLOAD_PAST_END = int(_S.PAYLOAD_PAST_END)
_OVERLAP = int(_S.OVERLAP)
_COUNT = int(_S.COUNT)
_SIZE_RANGE = int(_S.SIZE_RANGE)
_STORED_SIZE = int(_S.STORED_SIZE)


@njit(**KERNEL)
def _u16(buf, p):
    return np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)


@njit(**KERNEL)
def _u32(buf, p):
    return _u16(buf, p) | (_u16(buf, p + 2) << 16)


@njit(**KERNEL)
def _u64(buf, p):
    """A uint64 field as int64: values >= 2**63 come out negative (out of range)."""
    return _u32(buf, p) | (_u32(buf, p + 4) << 32)


@njit(**KERNEL)
def _sat_add(a, b):
    """``a + b`` for ``a, b >= 0``, saturated at ``2**63 - 1`` (for messages)."""
    return a + b if b <= _I64_MAX - a else _I64_MAX


@njit(**KERNEL)
def _fail(status, code, i, expected, found):
    status[0] = code
    status[1] = i
    status[2] = expected
    status[3] = found
    return False


@njit(**KERNEL)
def _check_local(buf, cols, i, cd_offset, status):
    """Reads and checks entry ``i``'s local header in ``buf`` (see :func:`_check_local_in`)."""
    return _check_local_in(buf, cols[i, _HOFF], buf, cols, i, cd_offset, status)


@njit(**KERNEL)
def _check_local_in(hdr, h, buf, cols, i, cd_offset, status):
    """Checks entry ``i``'s local header, whose bytes are at ``hdr[h:]``: the only copy of this check.

    ``hdr`` is ``buf`` itself (``h`` = the header offset) or a copy of the
    header's fixed part and name read from the file (:func:`check_local_headers`).
    Signature, name equal to the central name, payload and stored bytes
    within ``[header, next record)``. Fills the payload offset and the local
    extra length; returns False with ``status`` set on failure. Every bound is
    checked without overflow (offsets are < ``buf.size``, sizes may be up to
    ``2**63 - 1``), and no byte outside ``hdr`` or ``buf`` is read.
    """
    hoff = cols[i, _HOFF]
    limit = cols[i, _NEXT]
    nlen = cols[i, _NLEN]
    noff = cols[i, _NOFF]
    csize = cols[i, _CSIZE]
    if limit < 0 or limit > cd_offset or cd_offset > buf.size or hoff < 0 or hoff > limit - _LH_SIZEOF:
        return _fail(status, _HEADER_PAST_END, i, limit, hoff)
    if h < 0 or h > hdr.size - _LH_SIZEOF:  # a copy too short (never, for buf itself)
        return _fail(status, _HEADER_PAST_END, i, limit, hoff)
    sig = _u32(hdr, h)
    if sig != _LOCAL_SIG:
        return _fail(status, _LOCAL_SIGNATURE, i, _LOCAL_SIG, sig)
    lnlen = _u16(hdr, h + _LH_NAME_LEN)
    lelen = _u16(hdr, h + _LH_EXTRA_LEN)
    if lnlen != nlen:
        return _fail(status, _NAME_MISMATCH, i, nlen, lnlen)
    start = hoff + _LH_SIZEOF
    if nlen > limit - start:
        return _fail(status, _OVERLAP, i, start + nlen, limit)
    if nlen > hdr.size - (h + _LH_SIZEOF) or noff < 0 or nlen > buf.size - noff:
        return _fail(status, _HEADER_PAST_END, i, limit, hoff)  # never for a whole archive
    for k in range(nlen):
        if hdr[h + _LH_SIZEOF + k] != buf[noff + k]:
            return _fail(status, _NAME_MISMATCH, i, nlen, nlen)
    payload = start + lnlen + lelen
    if payload > limit or csize < 0 or csize > limit - payload:
        stop = _sat_add(payload, max(csize, 0))
        if stop > cd_offset:
            return _fail(status, _PAYLOAD_PAST_END, i, cd_offset, stop)
        return _fail(status, _OVERLAP, i, stop, limit)
    cols[i, _PAYLOAD] = payload
    cols[i, _LEXTRA] = lelen
    return True


@njit(**KERNEL)
def check_local_headers(buf, cols, cd_offset, hdr, hpos):
    """Checks every entry's local header from copies of their bytes and fills the
    payload offsets, as :func:`parse_central_directory` with ``check_local`` does.

    Parameters
    ----------
    buf : uint8 array
        The whole archive (for the central names and its size).
    cols : int64 array
        From :func:`parse_central_directory` (``check_local=False``), filled in place.
    cd_offset : int
        Start of the central directory.
    hdr : uint8 array
        Entry ``i``'s local header (30 bytes) and name, read from the file, at
        ``hdr[hpos[i]:]`` (reading them with ``pread`` costs no page fault per entry).
    hpos : int64 array
        One position in ``hdr`` per row of ``cols``.

    Returns
    -------
    status : int64 array of 4
        As :func:`parse_central_directory`'s; the first failing entry stops the pass.
    """
    status = np.zeros(4, np.int64)
    count = cols.shape[0]
    if hpos.shape[0] != count:
        _fail(status, _COUNT, -1, count, hpos.shape[0])
        return status
    for i in range(count):
        if not _check_local_in(hdr, hpos[i], buf, cols, i, cd_offset, status):
            return status
    return status


@njit(**KERNEL)
def resolve_local(buf, cols, i, cd_offset):
    """Checks entry ``i``'s local header now (see :func:`parse_central_directory`
    with ``check_local=False``) and fills its payload offset in ``cols``.

    Returns the status array ``[code, entry, expected, found]``.
    """
    status = np.zeros(4, np.int64)
    _check_local(buf, cols, i, cd_offset, status)
    return status


@njit(**KERNEL)
def parse_central_directory(buf, cd_offset, cd_size, count, check_local):
    """Parses every central record (and, with ``check_local``, its local header).

    Parameters
    ----------
    buf : uint8 array
        The whole archive (usually its memory map, possibly read-only).
    cd_offset, cd_size, count : int
        From the end-of-central-directory record (zip64 where present);
        checked again against ``buf``.
    check_local : bool
        Also read and check every local header (signature, name, payload
        bounds). Without it (a lazy open touches no payload page), payload
        offsets and local extra lengths are -1, to be filled per entry by
        :func:`resolve_local`; overlaps are then checked on the smallest
        extent a record can have (its fixed header, name and stored bytes).

    Returns
    -------
    cols : int64 array (count, len(records.Col))
        One row per entry, columns named by :class:`tdz_numba.zipfmt.records.Col`.
    status : int64 array of 4
        ``code, entry index, expected, found`` (:class:`tdz_numba.zipfmt.records.Status`).

    Notes
    -----
    Every value read from the file is treated as untrusted: uint64 fields
    >= 2**63 are out of range, and every bound is compared as
    ``value > limit - known`` so that no sum can overflow.
    """
    status = np.zeros(4, np.int64)
    if (
        cd_offset < 0
        or cd_size < 0
        or count < 0
        or cd_offset > buf.size
        or cd_size > buf.size - cd_offset
        or count > cd_size // _CD_SIZEOF
    ):
        _fail(status, _CENTRAL_OVERRUN, -1, buf.size, cd_offset)
        return np.zeros((0, _NCOLS), np.int64), status
    cols = np.zeros((count, _NCOLS), np.int64)
    end = cd_offset + cd_size
    p = cd_offset
    for i in range(count):
        if p > end - _CD_SIZEOF:
            _fail(status, _COUNT, i, count, i)
            return cols, status
        sig = _u32(buf, p)
        if sig != _CENTRAL_SIG:
            _fail(status, _CENTRAL_SIGNATURE, i, _CENTRAL_SIG, sig)
            return cols, status
        csize = _u32(buf, p + _CD_CSIZE)
        usize = _u32(buf, p + _CD_SIZE)
        hoff = _u32(buf, p + _CD_HEADER_OFFSET)
        nlen = _u16(buf, p + _CD_NAME_LEN)
        elen = _u16(buf, p + _CD_EXTRA_LEN)
        rec_end = p + _CD_SIZEOF + nlen + elen + _u16(buf, p + _CD_COMMENT_LEN)
        # name fields first: an error below can then name the entry
        cols[i, _FLAGS] = _u16(buf, p + _CD_FLAGS)
        cols[i, _NOFF] = p + _CD_SIZEOF
        cols[i, _NLEN] = nlen
        cols[i, _COFF] = p
        if rec_end > end:
            _fail(status, _CENTRAL_OVERRUN, i, end, rec_end)
            return cols, status
        # zip64 extra: values appear only for the fields set to 0xFFFFFFFF
        need = 0
        if usize == _U32_MAX:
            need += 1
        if csize == _U32_MAX:
            need += 1
        if hoff == _U32_MAX:
            need += 1
        if need:
            q = p + _CD_SIZEOF + nlen
            qend = q + elen
            found = False
            while q <= qend - _X_SIZEOF:
                tag = _u16(buf, q)
                size = _u16(buf, q + _X_LEN)
                if size > qend - q - _X_SIZEOF:
                    break
                if tag == _ZIP64_ID:
                    if size < 8 * need:
                        break
                    r = q + _X_SIZEOF
                    if usize == _U32_MAX:
                        usize = _u64(buf, r)
                        r += 8
                    if csize == _U32_MAX:
                        csize = _u64(buf, r)
                        r += 8
                    if hoff == _U32_MAX:
                        hoff = _u64(buf, r)
                    found = True
                    break
                q += _X_SIZEOF + size
            if not found:
                _fail(status, _ZIP64_EXTRA, i, need, 0)
                return cols, status
        if hoff < 0 or hoff > cd_offset - _LH_SIZEOF:
            _fail(status, _HEADER_PAST_END, i, cd_offset, hoff)
            return cols, status
        if csize < 0:
            _fail(status, _SIZE_RANGE, i, _I64_MAX, csize)
            return cols, status
        if usize < 0:
            _fail(status, _SIZE_RANGE, i, _I64_MAX, usize)
            return cols, status
        method = _u16(buf, p + _CD_METHOD)
        if method == _STORED and usize != csize:
            _fail(status, _STORED_SIZE, i, csize, usize)
            return cols, status
        cols[i, _METHOD] = method
        cols[i, _CRC] = _u32(buf, p + _CD_CRC)
        cols[i, _CSIZE] = csize
        cols[i, _SIZE] = usize
        cols[i, _HOFF] = hoff
        cols[i, _TIME] = _u16(buf, p + _CD_TIME)
        cols[i, _DATE] = _u16(buf, p + _CD_DATE)
        cols[i, _PAYLOAD] = -1
        cols[i, _LEXTRA] = -1
        p = rec_end
    # Records must not overlap: sorted by header offset, each record's
    # smallest extent (header, name, stored bytes) ends before the next starts.
    order = np.argsort(cols[:, _HOFF], kind="mergesort")
    for j in range(count):
        a = order[j]
        limit = cols[order[j + 1], _HOFF] if j + 1 < count else cd_offset
        cols[a, _NEXT] = limit
        least = cols[a, _HOFF] + _LH_SIZEOF + cols[a, _NLEN]  # <= cd_offset + 65535: no overflow
        csize = cols[a, _CSIZE]
        if least > limit or csize > limit - least:
            stop = _sat_add(least, csize)
            if stop > cd_offset:
                _fail(status, _PAYLOAD_PAST_END, a, cd_offset, stop)
            else:
                _fail(status, _OVERLAP, a, stop, limit)
            return cols, status
    if check_local:
        for i in range(count):
            if not _check_local(buf, cols, i, cd_offset, status):
                return cols, status
    if p != end:  # more records than the end record counts
        _fail(status, _COUNT, count, count, -1)
    return cols, status
