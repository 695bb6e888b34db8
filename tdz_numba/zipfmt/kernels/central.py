"""Numba kernels of the central-directory index: the one parser and the local-header checks.

:func:`parse_central` walks a central directory once: it checks every record (signature,
bounds, zip64 values, sizes), fills the index columns (:class:`tdz_numba.zipfmt.records.Col`),
checks that no two entries overlap, copies every name into one NUL-separated buffer (so
that Python builds all names with one ``decode`` and one ``split``) and notes the first
encrypted entry and the first of an unknown method; walking each record's extra field
(every block must end inside it, as zipfile requires), it notes where each entry's digest
(:class:`tdz_numba.zipfmt.records.DigestExtra`) lies. Its pure-Python twin is
:func:`tdz_numba.zipfmt.kernels.central_twin.parse_central` (the same checks in the same
order, the same status codes and columns); :mod:`tdz_numba.zipfmt.kernels.dispatch`
runs one or the other, and :mod:`tdz_numba.zipfmt.central` turns the status into errors.

:func:`resolve_local` and :func:`check_local_headers` read the local headers later: one
entry on first use (a lazy open), or every entry (``check_local``, ``check_all``).

Record layouts, field offsets, index columns and status codes come from
:mod:`tdz_numba.zipfmt.records` (frozen into the compiled code as constants). Every value
read from the file is treated as untrusted: uint64 fields >= 2**63 are out of range, and
every bound is compared as ``value > limit - known`` so that no sum can overflow.

Examples
--------
>>> import numpy as np, tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.zipfmt import eocd, records
>>> from tdz_numba.zipfmt.kernels import central
>>> with tempfile.TemporaryDirectory() as d:
...     data = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz").read_bytes()
>>> end = eocd.find_end_record(data)
>>> cd = data[end.cd_offset : end.cd_offset + end.cd_size]
>>> cols = np.zeros((end.count, len(records.Col)), np.int64)
>>> joined, out = bytearray(len(cd)), np.zeros(central.OUT_LEN, np.int64)
>>> digests = np.zeros(end.count, np.int64)
>>> central.parse_central(cd, end.cd_offset, end.count, cols, joined, out, digests)
0
>>> digests.tolist(), int(out[central.OUT_DIGESTS])  # (no digest blocks: save(digest=False))
([-1, -1], 0)
>>> bytes(joined[: out[central.OUT_NAMES]]), cols[:, records.Col.NEXT_OFFSET].tolist() == [
...     cols[1, records.Col.HEADER_OFFSET], end.cd_offset]
(b'meta.json\\x00a.memmap', True)
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ...errors import InternalError
from ...jit.presets import KERNEL
from .. import records

__all__ = [
    "OUT_LEN",
    "OUT_NAMES",
    "OUT_ENCRYPTED",
    "OUT_METHOD",
    "OUT_DIGESTS",
    "BAD_ARGUMENTS",
    "parse_central",
    "check_entry_header",
    "resolve_local",
    "check_local_headers",
]

#: ``out`` of :func:`parse_central`: ``[code, entry, expected, found]`` (the status, as
#: :class:`tdz_numba.zipfmt.records.Status` describes it), then the length of the joined
#: names (-1: a name holds a NUL or a byte >= 0x80), the first encrypted entry and the
#: first entry of an unknown compression method (-1: none), the number of entries with a
#: digest block. The last four are set only when the status is OK.
OUT_LEN = 8
OUT_NAMES = 4
OUT_ENCRYPTED = 5
OUT_METHOD = 6
OUT_DIGESTS = 7
#: Returned by :func:`parse_central` when its output arrays do not fit (a caller's bug, never the file's).
BAD_ARGUMENTS = -1

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
_DIGEST_ID = records.DIGEST_EXTRA_ID
_DIGEST_LEN = int(records.DigestExtra.SIZEOF) - _X_SIZEOF
_DIGEST_ALGO = int(records.DigestExtra.ALGO)
_DIGEST_VALUE = int(records.DigestExtra.VALUE)
_XXH3_128 = records.DIGEST_XXH3_128
_LOCAL_SIG = records.LOCAL_SIG
_CENTRAL_SIG = records.CENTRAL_SIG
_STORED = records.STORED
_ENCRYPTED = records.FLAG_ENCRYPTED
_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1
_KNOWN = tuple(sorted(records.METHOD_NAMES))
if len(_KNOWN) != 4:  # the kernel tests the method against four constants
    raise InternalError(f"kernels.central: {len(_KNOWN)} compression methods, the kernel knows 4")
_M0, _M1, _M2, _M3 = _KNOWN

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
_EXTRA_OVERRUN = int(_S.EXTRA_OVERRUN)


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
def _zip64(cd, q, qend, usize, csize, hoff):
    """The zip64 extra values of one central record (in ``cd[q:qend]``): ``(found, usize,
    csize, hoff)``; values appear only for the fields set to 0xFFFFFFFF."""
    need = 0
    if usize == _U32_MAX:
        need += 1
    if csize == _U32_MAX:
        need += 1
    if hoff == _U32_MAX:
        need += 1
    while q <= qend - _X_SIZEOF:
        tag = _u16(cd, q)
        size = _u16(cd, q + _X_LEN)
        if size > qend - q - _X_SIZEOF:
            break
        if tag == _ZIP64_ID:
            if size < 8 * need:
                break
            r = q + _X_SIZEOF
            if usize == _U32_MAX:
                usize = _u64(cd, r)
                r += 8
            if csize == _U32_MAX:
                csize = _u64(cd, r)
                r += 8
            if hoff == _U32_MAX:
                hoff = _u64(cd, r)
            return True, usize, csize, hoff
        q += _X_SIZEOF + size
    return False, usize, csize, hoff


@njit(**KERNEL)
def _overlap_check(cols, a, limit, cd_offset, out):
    """Entry ``a``'s smallest extent (header, name, stored bytes) must end by ``limit``
    (the next record in file order); fills its ``NEXT_OFFSET``."""
    cols[a, _NEXT] = limit
    least = cols[a, _HOFF] + _LH_SIZEOF + cols[a, _NLEN]  # <= cd_offset + 65535: no overflow
    csize = cols[a, _CSIZE]
    if least > limit or csize > limit - least:
        stop = _sat_add(least, csize)
        if stop > cd_offset:
            return _fail(out, _PAYLOAD_PAST_END, a, cd_offset, stop)
        return _fail(out, _OVERLAP, a, stop, limit)
    return True


@njit(**KERNEL)
def _extra_blocks(cd, x, xend, cd_offset, i, digests, out):
    """Walks the extra field ``cd[x:xend]`` of record ``i``: every block must end inside it
    (else EXTRA_OVERRUN, as zipfile refuses it; 1-3 trailing bytes are ignored, as zipfile
    does); ``digests[i]`` = where the value of its digest block lies in ``cd`` (-1: none).
    Returns 1 when it found a digest, 0 when not, -1 on failure (``out`` set)."""
    found = 0
    while x <= xend - _X_SIZEOF:
        size = _u16(cd, x + _X_LEN)
        if size > xend - x - _X_SIZEOF:
            _fail(out, _EXTRA_OVERRUN, i, cd_offset + xend, cd_offset + x + _X_SIZEOF + size)
            return -1
        if size == _DIGEST_LEN and _u16(cd, x) == _DIGEST_ID and cd[x + _DIGEST_ALGO] == _XXH3_128:
            digests[i] = x + _DIGEST_VALUE
            found = 1
        x += _X_SIZEOF + size
    return found


@njit(**KERNEL)
def parse_central(cd, cd_offset, count, cols, joined, out, digests):
    """Parses every central record of a central directory: the only copy of these checks.

    Parameters
    ----------
    cd : uint8 array or bytes
        The central directory's bytes (possibly read-only); the caller checked that it
        lies inside the file (:func:`tdz_numba.zipfmt.eocd.central_directory_fits`).
    cd_offset : int
        Where it starts in the file: offsets in ``cols`` are file offsets, and local
        headers must lie before it.
    count : int
        The records the end record lists.
    cols : int64 array (>= count, len(records.Col)), zeros
        Filled with one row per entry (:class:`tdz_numba.zipfmt.records.Col`); payload
        offsets and local extra lengths are -1 (:func:`resolve_local` fills them).
    joined : uint8 array or bytearray of >= ``len(cd)``
        Filled with the names, separated by one NUL byte each.
    out : int64 array of :data:`OUT_LEN`
        Filled as :data:`OUT_LEN` describes.
    digests : int64 array of >= count
        Filled with where each entry's 16-byte digest lies in ``cd`` (-1: no digest block).

    Returns
    -------
    int
        The status code (``out[0]``), or :data:`BAD_ARGUMENTS`.

    Notes
    -----
    The checks run in this order, the first failure ending the walk: per record (in
    the central directory's order) the count, signature, record bounds, zip64 values,
    header offset, size range and STORED size; then, every record read, overlaps in
    file order (the records sorted by header offset, stably, when the directory lists
    them in another order); then whether more bytes follow the last counted record.
    The columns of a failed walk are those filled so far (the failing record's name
    fields included once its bounds are known), as the twin fills them.
    """
    n = len(cd)
    if len(out) < OUT_LEN:
        return BAD_ARGUMENTS
    for k in range(OUT_LEN):
        out[k] = 0
    out[OUT_NAMES] = -1
    out[OUT_ENCRYPTED] = -1
    out[OUT_METHOD] = -1
    if cd_offset < 0 or count < 0 or count > n // _CD_SIZEOF:  # (never, after central_directory_fits)
        _fail(out, _CENTRAL_OVERRUN, -1, n, cd_offset)
        return out[0]
    if cols.shape[0] < count or cols.shape[1] != _NCOLS or len(joined) < n or len(digests) < count:
        return BAD_ARGUMENTS
    n_digests = 0
    header_limit = cd_offset - _LH_SIZEOF
    p = 0
    j = 0  # bytes of names written: j <= p (each record holds its name and 46 more bytes)
    plain = True
    in_order = True
    prev_hoff = np.int64(-1)
    encrypted = -1
    unknown = -1
    for i in range(count):
        if p > n - _CD_SIZEOF:
            _fail(out, _COUNT, i, count, i)
            return out[0]
        sig = _u32(cd, p)
        if sig != _CENTRAL_SIG:
            _fail(out, _CENTRAL_SIGNATURE, i, _CENTRAL_SIG, sig)
            return out[0]
        csize = _u32(cd, p + _CD_CSIZE)
        usize = _u32(cd, p + _CD_SIZE)
        hoff = _u32(cd, p + _CD_HEADER_OFFSET)
        nlen = _u16(cd, p + _CD_NAME_LEN)
        elen = _u16(cd, p + _CD_EXTRA_LEN)
        q = p + _CD_SIZEOF
        rec_end = q + nlen + elen + _u16(cd, p + _CD_COMMENT_LEN)
        flags = _u16(cd, p + _CD_FLAGS)
        # name fields first: an error below can then name the entry
        cols[i, _FLAGS] = flags
        cols[i, _NOFF] = cd_offset + q
        cols[i, _NLEN] = nlen
        cols[i, _COFF] = cd_offset + p
        if rec_end > n:
            _fail(out, _CENTRAL_OVERRUN, i, cd_offset + n, cd_offset + rec_end)
            return out[0]
        digests[i] = -1
        if elen:
            found_digest = _extra_blocks(cd, q + nlen, q + nlen + elen, cd_offset, i, digests, out)
            if found_digest < 0:
                return out[0]
            n_digests += found_digest
        if usize == _U32_MAX or csize == _U32_MAX or hoff == _U32_MAX:
            found, usize, csize, hoff = _zip64(cd, q + nlen, q + nlen + elen, usize, csize, hoff)
            if not found:
                need = 0
                for v in (usize, csize, hoff):
                    if v == _U32_MAX:
                        need += 1
                _fail(out, _ZIP64_EXTRA, i, need, 0)
                return out[0]
        if hoff < 0 or hoff > header_limit:
            _fail(out, _HEADER_PAST_END, i, cd_offset, hoff)
            return out[0]
        if csize < 0:
            _fail(out, _SIZE_RANGE, i, _I64_MAX, csize)
            return out[0]
        if usize < 0:
            _fail(out, _SIZE_RANGE, i, _I64_MAX, usize)
            return out[0]
        method = _u16(cd, p + _CD_METHOD)
        if method == _STORED and usize != csize:
            _fail(out, _STORED_SIZE, i, csize, usize)
            return out[0]
        cols[i, _METHOD] = method
        cols[i, _CRC] = _u32(cd, p + _CD_CRC)
        cols[i, _CSIZE] = csize
        cols[i, _SIZE] = usize
        cols[i, _HOFF] = hoff
        cols[i, _TIME] = _u16(cd, p + _CD_TIME)
        cols[i, _DATE] = _u16(cd, p + _CD_DATE)
        cols[i, _PAYLOAD] = -1
        cols[i, _LEXTRA] = -1
        if hoff < prev_hoff:
            in_order = False
        prev_hoff = hoff
        if encrypted < 0 and flags & _ENCRYPTED:
            encrypted = i
        if unknown < 0 and method != _M0 and method != _M1 and method != _M2 and method != _M3:
            unknown = i
        if plain:
            if i:
                joined[j] = 0
                j += 1
            for k in range(q, q + nlen):  # q + nlen <= rec_end <= n
                b = cd[k]
                if b == 0 or b >= 0x80:
                    plain = False  # a NUL splits wrongly; bytes >= 0x80: decoded by Python
                    break
                joined[j] = b
                j += 1
        p = rec_end
    # Records must not overlap: in file order (sorted by header offset when the
    # directory lists them otherwise), each record's smallest extent ends before the next.
    if in_order:
        for a in range(count):
            limit = cols[a + 1, _HOFF] if a + 1 < count else cd_offset
            if not _overlap_check(cols, a, limit, cd_offset, out):
                return out[0]
    else:
        order = np.argsort(cols[:count, _HOFF], kind="mergesort")
        for k in range(count):
            limit = cols[order[k + 1], _HOFF] if k + 1 < count else cd_offset
            if not _overlap_check(cols, order[k], limit, cd_offset, out):
                return out[0]
    if p != n:  # more records than the end record counts
        _fail(out, _COUNT, count, count, -1)
        return out[0]
    out[OUT_NAMES] = j if plain else -1
    out[OUT_ENCRYPTED] = encrypted
    out[OUT_METHOD] = unknown
    out[OUT_DIGESTS] = n_digests
    return _OK


@njit(**KERNEL)
def check_entry_header(hdr, h, buf, cols, i, cd_offset, status):
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
    """Checks every entry's local header and fills the payload offsets, in entry order.

    Parameters
    ----------
    buf : uint8 array
        The whole archive (for the central names and its size).
    cols : int64 array
        From :func:`parse_central`, filled in place.
    cd_offset : int
        Start of the central directory.
    hdr : uint8 array
        Entry ``i``'s local header (30 bytes) and name at ``hdr[hpos[i]:]``: ``buf`` itself
        with ``hpos`` the header offsets, or copies read from the file (reading them with
        ``pread`` costs no page fault per entry).
    hpos : int64 array
        One position in ``hdr`` per row of ``cols``.

    Returns
    -------
    status : int64 array of 4
        ``[code, entry, expected, found]``; the first failing entry stops the pass.
    """
    status = np.zeros(4, np.int64)
    count = cols.shape[0]
    if hpos.shape[0] != count:
        _fail(status, _COUNT, -1, count, hpos.shape[0])
        return status
    for i in range(count):
        if not check_entry_header(hdr, hpos[i], buf, cols, i, cd_offset, status):
            return status
    return status


@njit(**KERNEL)
def resolve_local(buf, cols, i, cd_offset):
    """Checks entry ``i``'s local header in ``buf`` now (:func:`check_entry_header`) and fills
    its payload offset in ``cols``. Returns the status array ``[code, entry, expected, found]``."""
    status = np.zeros(4, np.int64)
    check_entry_header(buf, cols[i, _HOFF], buf, cols, i, cd_offset, status)
    return status
