"""Kernel twins without Numba: the save and load kernels in plain Python, numpy and zlib-ng.

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

from .. import eocd, records

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency
    from zlib import crc32 as _crc32

__all__ = [
    "crc32_combine",
    "crc32_zeros",
    "crc32_spans",
    "plan_layout",
    "parse_central_directory",
    "resolve_local",
    "check_local_headers",
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


# --------------------------------------------------------------------------
# Central directory index (the same checks, in the same order, as the kernel)
# --------------------------------------------------------------------------
_CD = records.CENTRAL_STRUCT
_LH = records.LOCAL_STRUCT
_CD_SIZEOF = int(records.Central.SIZEOF)
_LH_SIZEOF = int(records.Local.SIZEOF)
_X_SIZEOF = int(records.Extra.SIZEOF)
_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1
_NCOLS = len(records.Col)
_C = records.Col
_S = records.Status


def _signed64(v: int) -> int:
    """A uint64 field as the kernel's int64: values >= 2**63 come out negative."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _sat_add(a: int, b: int) -> int:
    return a + b if b <= _I64_MAX - a else _I64_MAX


def _fail(status: np.ndarray, code: int, i: int, expected: int, found: int) -> bool:
    status[:] = (int(code), i, expected, found)
    return False


def _check_local(buf, mv: memoryview, cols: np.ndarray, i: int, cd_offset: int, status: np.ndarray) -> bool:
    """The twin of ``kernels._check_local``: the header read from ``buf`` itself."""
    return _check_local_in(mv, int(cols[i, _C.HEADER_OFFSET]), buf, mv, cols, i, cd_offset, status)


def _check_local_in(
    hmv, h: int, buf, mv: memoryview, cols: np.ndarray, i: int, cd_offset: int, status
) -> bool:
    """The twin of ``kernels._check_local_in``: fills the payload offset and local extra length of row ``i``."""
    row = cols[i].tolist()
    hoff, limit, nlen = row[_C.HEADER_OFFSET], row[_C.NEXT_OFFSET], row[_C.NAME_LEN]
    noff, csize = row[_C.NAME_OFFSET], row[_C.CSIZE]
    if limit < 0 or limit > cd_offset or cd_offset > buf.size or hoff < 0 or hoff > limit - _LH_SIZEOF:
        return _fail(status, _S.HEADER_PAST_END, i, limit, hoff)
    if h < 0 or h > len(hmv) - _LH_SIZEOF:
        return _fail(status, _S.HEADER_PAST_END, i, limit, hoff)
    head = _LH.unpack_from(hmv, h)
    sig, lnlen, lelen = head[0], head[9], head[10]
    if sig != records.LOCAL_SIG:
        return _fail(status, _S.LOCAL_SIGNATURE, i, records.LOCAL_SIG, sig)
    if lnlen != nlen:
        return _fail(status, _S.NAME_MISMATCH, i, nlen, lnlen)
    start = hoff + _LH_SIZEOF
    if nlen > limit - start:
        return _fail(status, _S.OVERLAP, i, start + nlen, limit)
    if nlen > len(hmv) - (h + _LH_SIZEOF) or noff < 0 or nlen > len(mv) - noff:
        return _fail(status, _S.HEADER_PAST_END, i, limit, hoff)
    if hmv[h + _LH_SIZEOF : h + _LH_SIZEOF + nlen] != mv[noff : noff + nlen]:
        return _fail(status, _S.NAME_MISMATCH, i, nlen, nlen)
    payload = start + lnlen + lelen
    if payload > limit or csize < 0 or csize > limit - payload:
        stop = _sat_add(payload, max(csize, 0))
        if stop > cd_offset:
            return _fail(status, _S.PAYLOAD_PAST_END, i, cd_offset, stop)
        return _fail(status, _S.OVERLAP, i, stop, limit)
    cols[i, _C.PAYLOAD_OFFSET] = payload
    cols[i, _C.LOCAL_EXTRA_LEN] = lelen
    return True


def check_local_headers(
    buf, cols: np.ndarray, cd_offset: int, hdr: np.ndarray, hpos: np.ndarray
) -> np.ndarray:
    """The twin of :func:`tdz_numba.zipfmt.kernels.crc.check_local_headers`."""
    status = np.zeros(4, np.int64)
    count = len(cols)
    if len(hpos) != count:
        _fail(status, _S.COUNT, -1, count, len(hpos))
        return status
    mv, hmv = _bytes_view(buf), _bytes_view(hdr)
    for i, h in enumerate(hpos.tolist()):
        if not _check_local_in(hmv, h, buf, mv, cols, i, int(cd_offset), status):
            break
    return status


def _bytes_view(buf) -> memoryview:
    return np.ascontiguousarray(buf).reshape(-1).data.cast("B")


def resolve_local(buf, cols: np.ndarray, i: int, cd_offset: int) -> np.ndarray:
    """Checks entry ``i``'s local header and fills its payload offset; returns the status array."""
    status = np.zeros(4, np.int64)
    _check_local(buf, _bytes_view(buf), cols, int(i), int(cd_offset), status)
    return status


def _zip64(mv: memoryview, q: int, qend: int, usize: int, csize: int, hoff: int, need: int):
    """The zip64 extra values of one central record, or None when they are missing."""
    while q <= qend - _X_SIZEOF:
        tag, size = records.EXTRA_STRUCT.unpack_from(mv, q)
        if size > qend - q - _X_SIZEOF:
            return None
        if tag == records.ZIP64_EXTRA_ID:
            if size < 8 * need:
                return None
            r = q + _X_SIZEOF
            if usize == _U32_MAX:
                usize = _signed64(records.U64_STRUCT.unpack_from(mv, r)[0])
                r += 8
            if csize == _U32_MAX:
                csize = _signed64(records.U64_STRUCT.unpack_from(mv, r)[0])
                r += 8
            if hoff == _U32_MAX:
                hoff = _signed64(records.U64_STRUCT.unpack_from(mv, r)[0])
            return usize, csize, hoff
        q += _X_SIZEOF + size
    return None


def parse_central_directory(buf, cd_offset: int, cd_size: int, count: int, check_local: bool):
    """Every central record (and with ``check_local`` its local header): what
    :func:`tdz_numba.zipfmt.kernels.crc.parse_central_directory` returns, ``(cols, status)``."""
    status = np.zeros(4, np.int64)
    cd_offset, cd_size, count, size = int(cd_offset), int(cd_size), int(count), int(buf.size)
    if not eocd.central_directory_fits(size, cd_offset, cd_size, count):
        _fail(status, _S.CENTRAL_OVERRUN, -1, size, cd_offset)
        return np.zeros((0, _NCOLS), np.int64), status
    mv = _bytes_view(buf)
    cols = np.zeros((count, _NCOLS), np.int64)
    rows: list[list[int]] = []
    end = cd_offset + cd_size
    p = cd_offset

    def failed(code: int, i: int, expected: int, found: int, partial: bool) -> tuple[np.ndarray, np.ndarray]:
        if rows:
            cols[: len(rows)] = rows
        if partial:  # the name fields are filled first: the error can name the entry
            cols[i, _C.FLAGS], cols[i, _C.NAME_OFFSET], cols[i, _C.NAME_LEN], cols[i, _C.CENTRAL_OFFSET] = pf
        _fail(status, code, i, expected, found)
        return cols, status

    pf = (0, 0, 0, 0)
    unpack = _CD.unpack_from
    for i in range(count):
        if p > end - _CD_SIZEOF:
            return failed(_S.COUNT, i, count, i, False)
        rec = unpack(mv, p)
        sig = rec[0]
        if sig != records.CENTRAL_SIG:
            return failed(_S.CENTRAL_SIGNATURE, i, records.CENTRAL_SIG, sig, False)
        flags, method, dtime, ddate, crc, csize, usize, nlen, elen, clen, hoff = (
            rec[3],
            rec[4],
            rec[5],
            rec[6],
            rec[7],
            rec[8],
            rec[9],
            rec[10],
            rec[11],
            rec[12],
            rec[16],
        )
        rec_end = p + _CD_SIZEOF + nlen + elen + clen
        pf = (flags, p + _CD_SIZEOF, nlen, p)
        if rec_end > end:
            return failed(_S.CENTRAL_OVERRUN, i, end, rec_end, True)
        need = (usize == _U32_MAX) + (csize == _U32_MAX) + (hoff == _U32_MAX)
        if need:
            q = p + _CD_SIZEOF + nlen
            found = _zip64(mv, q, q + elen, usize, csize, hoff, need)
            if found is None:
                return failed(_S.ZIP64_EXTRA, i, need, 0, True)
            usize, csize, hoff = found
        if hoff < 0 or hoff > cd_offset - _LH_SIZEOF:
            return failed(_S.HEADER_PAST_END, i, cd_offset, hoff, True)
        if csize < 0:
            return failed(_S.SIZE_RANGE, i, _I64_MAX, csize, True)
        if usize < 0:
            return failed(_S.SIZE_RANGE, i, _I64_MAX, usize, True)
        if method == records.STORED and usize != csize:
            return failed(_S.STORED_SIZE, i, csize, usize, True)
        # Col order: flags method crc csize size hoff noff nlen payload coff time date lextra next
        rows.append(
            [flags, method, crc, csize, usize, hoff, p + _CD_SIZEOF, nlen, -1, p, dtime, ddate, -1, 0]
        )
        p = rec_end
    if rows:
        cols[:] = rows
    # records must not overlap: sorted by header offset, each record's smallest
    # extent (header, name, stored bytes) ends before the next starts
    if count:
        hoffs = cols[:, _C.HEADER_OFFSET]
        order = np.argsort(hoffs, kind="mergesort")
        limits = np.empty(count, np.int64)
        limits[:-1] = hoffs[order[1:]]
        limits[-1] = cd_offset
        least = hoffs[order] + _LH_SIZEOF + cols[order, _C.NAME_LEN]
        csz = cols[order, _C.CSIZE]
        bad = np.nonzero((least > limits) | (csz > limits - least))[0]
        stop_at = int(bad[0]) if bad.size else count
        cols[order[: stop_at + 1], _C.NEXT_OFFSET] = limits[: stop_at + 1]
        if bad.size:
            j = stop_at
            a, stop = int(order[j]), _sat_add(int(least[j]), int(csz[j]))
            if stop > cd_offset:
                _fail(status, _S.PAYLOAD_PAST_END, a, cd_offset, stop)
            else:
                _fail(status, _S.OVERLAP, a, stop, int(limits[j]))
            return cols, status
    if check_local:
        for i in range(count):
            if not _check_local(buf, mv, cols, i, cd_offset, status):
                return cols, status
    if p != end:  # more records than the end record counts
        _fail(status, _S.COUNT, count, count, -1)
    return cols, status
