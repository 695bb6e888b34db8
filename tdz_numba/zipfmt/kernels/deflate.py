"""Numba kernels for parallel raw deflate and inflate with zlib-ng.

A large entry is cut into independent *segments*. Each is deflated by its own
zlib-ng stream, ended with a full flush (the last one with ``Z_FINISH``), so
that the concatenation is ONE standard raw-deflate stream that ``unzip``,
:mod:`zipfile` and tensordict decode as usual, while tdz_numba, knowing the
segment boundaries, inflates every segment in parallel straight into the
leaf's preallocated output.

Kernels take arrays of addresses and lengths and return arrays of sizes, CRCs
and zlib status codes; the Python wrappers in :mod:`tdz_numba.zipfmt.compression` check
them.

Examples
--------
>>> import numpy as np, zlib
>>> from tdz_numba.zipfmt.kernels import deflate as ck
>>> data = np.frombuffer(bytes(100_000), np.uint8)
>>> out = np.empty(ck.deflate_bound(data.size), np.uint8)
>>> n, crc, status = ck.deflate_segments(
...     np.array([data.ctypes.data], np.int64), np.array([data.size], np.int64),
...     np.array([out.ctypes.data], np.int64), np.array([out.size], np.int64),
...     np.array([True]), 6)
>>> zlib.decompress(out[: n[0]].tobytes(), wbits=-15) == data.tobytes(), int(status[0])
(True, 1)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...jit.presets import (
    KERNEL,
    PARALLEL,
    zng_crc32_z,
    zng_deflate,
    zng_deflateEnd,
    zng_deflateInit2,
    zng_inflate,
    zng_inflateEnd,
    zng_inflateInit2,
)

__all__ = [
    "deflate_bound",
    "deflate_segments",
    "inflate_segments",
    "inflate_open",
    "inflate_step",
    "inflate_close",
    "Z_OK",
    "Z_STREAM_END",
    "MAX_SEGMENT",
    "FEED",
]

Z_OK = 0
Z_STREAM_END = 1
Z_FULL_FLUSH = 3
Z_FINISH = 4
_Z_DEFLATED = 8
#: zng_stream is 13 machine words on 64-bit platforms; fields used here:
_NEXT_IN, _AVAIL_IN, _TOTAL_IN, _NEXT_OUT, _AVAIL_OUT, _TOTAL_OUT = 0, 1, 2, 3, 4, 5
_STREAM_WORDS = 13
#: Largest deflate segment (input bytes of one ``deflate_segments`` row): its
#: worst-case output must fit zng_stream's 32-bit ``avail_out``.
MAX_SEGMENT = 1 << 30
#: Largest ``avail_in`` / ``avail_out`` given to zlib-ng in one call: longer
#: inputs and outputs (a >= 4 GiB entry) are fed in pieces of this size.
FEED = 1 << 30
_U32 = 0xFFFFFFFF


@njit(**KERNEL)
def deflate_bound(n):
    """Upper bound of a raw deflate segment's size for ``n`` input bytes (stored
    blocks cost 5 bytes per 16 KiB at worst, plus the flush marker)."""
    return n + (n >> 12) + (n >> 10) + 64


@njit(**PARALLEL)
def deflate_segments(src, src_len, dst, dst_cap, last, level):
    """Deflates each segment ``src[i]`` into ``dst[i]``, in parallel.

    Returns ``(out_len, crc, status)``: compressed sizes, CRC-32 of each input
    segment (hashed while it is in cache), and zlib's return code
    (``Z_STREAM_END`` for ``last`` segments, ``Z_OK`` for full-flushed ones;
    a negative value is an error). Segments must be <= ``MAX_SEGMENT`` bytes.
    """
    n = src.size
    out_len = np.zeros(n, np.int64)
    crc = np.zeros(n, np.uint32)
    status = np.zeros(n, np.int64)
    for i in prange(n):
        if src_len[i] < 0 or src_len[i] > MAX_SEGMENT or dst_cap[i] < 0 or dst_cap[i] > _U32:
            status[i] = -2  # Z_STREAM_ERROR: 32-bit avail_in / avail_out
            continue
        strm = np.zeros(_STREAM_WORDS, np.uint64)
        p = strm.ctypes.data
        rc = zng_deflateInit2(
            p, np.int32(level), np.int32(_Z_DEFLATED), np.int32(-15), np.int32(8), np.int32(0)
        )
        if rc != Z_OK:
            status[i] = rc
            continue
        strm[_NEXT_IN] = src[i]
        strm[_AVAIL_IN] = src_len[i]
        strm[_NEXT_OUT] = dst[i]
        strm[_AVAIL_OUT] = dst_cap[i]
        flush = Z_FINISH if last[i] else Z_FULL_FLUSH
        rc = zng_deflate(p, np.int32(flush))
        done = strm[_AVAIL_IN] == 0 and (
            rc == Z_STREAM_END if last[i] else rc == Z_OK and strm[_AVAIL_OUT] > 0
        )
        status[i] = rc if done else -5  # Z_BUF_ERROR: the bound was too small
        out_len[i] = np.int64(strm[_TOTAL_OUT])
        zng_deflateEnd(p)
        crc[i] = zng_crc32_z(np.uint32(0), src[i], src_len[i])
        strm[0] = 0  # keep strm alive until here
    return out_len, crc, status


@njit(**KERNEL)
def _feed(p, strm, src, src_len, dst, dst_cap, stop_when_full):
    """Runs ``zng_inflate`` on ``src_len`` input bytes and ``dst_cap`` output
    bytes (64-bit counts, fed in <= ``FEED`` pieces to the 32-bit fields).

    Never writes outside ``dst[0:dst_cap]``. Stops at the end of the stream,
    on an error, when no progress is possible, or (``stop_when_full``) when the
    output is full. Returns ``(consumed, produced, last zlib code)``.
    """
    consumed = np.int64(0)
    produced = np.int64(0)
    rc = np.int32(0)
    while True:
        a_in = min(src_len - consumed, FEED)
        a_out = min(dst_cap - produced, FEED)
        strm[_NEXT_IN] = src + consumed
        strm[_AVAIL_IN] = a_in
        strm[_NEXT_OUT] = dst + produced
        strm[_AVAIL_OUT] = a_out
        rc = zng_inflate(p, np.int32(0))  # Z_NO_FLUSH
        used = a_in - np.int64(strm[_AVAIL_IN] & _U32)
        got = a_out - np.int64(strm[_AVAIL_OUT] & _U32)
        consumed += used
        produced += got
        if rc == Z_STREAM_END or (rc < 0 and rc != -5):
            break
        if used == 0 and got == 0:
            break
        if stop_when_full and produced == dst_cap:
            break
    return consumed, produced, rc


@njit(**PARALLEL)
def inflate_segments(src, src_len, dst, dst_len, last):
    """Inflates each raw-deflate segment ``src[i]`` into exactly ``dst_len[i]`` bytes at ``dst[i]``.

    Lengths are 64-bit: zlib-ng gets them in <= ``FEED`` pieces, so one
    segment (a whole entry without a segment table) may be larger than 4 GiB.
    Never writes past ``dst[i] + dst_len[i]``, whatever the stream says.

    Returns ``(crc, status)``: CRC-32 of each output segment and a status:
    0 when the segment consumed all its input and produced exactly
    ``dst_len[i]`` bytes (and ended the stream when ``last[i]``); otherwise
    zlib's negative code, or 2 (output too short), 3 (output too long / input
    left over), 4 (no end of stream where the last segment ends).
    """
    n = src.size
    crc = np.zeros(n, np.uint32)
    status = np.zeros(n, np.int64)
    for i in prange(n):
        if src_len[i] < 0 or dst_len[i] < 0:
            status[i] = -2
            continue
        strm = np.zeros(_STREAM_WORDS, np.uint64)
        p = strm.ctypes.data
        rc = zng_inflateInit2(p, np.int32(-15))
        if rc != Z_OK:
            status[i] = rc
            continue
        consumed, produced, rc = _feed(p, strm, src[i], src_len[i], dst[i], dst_len[i], False)
        zng_inflateEnd(p)
        if rc < 0 and rc != -5:
            status[i] = rc
        elif produced < dst_len[i]:
            status[i] = 2
        elif consumed < src_len[i]:
            status[i] = 3
        elif last[i] and rc != Z_STREAM_END:
            status[i] = 4
        elif not last[i] and rc == Z_STREAM_END:
            status[i] = 3
        else:
            status[i] = 0
        if status[i] == 0:
            crc[i] = zng_crc32_z(np.uint32(0), dst[i], dst_len[i])
        strm[0] = 0
    return crc, status


@njit(**KERNEL)
def inflate_open(strm):
    """Initializes a raw-inflate stream in ``strm`` (``uint64[13]``, which must
    not move until :func:`inflate_close`). Returns zlib's code."""
    return zng_inflateInit2(strm.ctypes.data, np.int32(-15))


@njit(**KERNEL)
def inflate_step(strm, src, src_len, dst, dst_cap, crc):
    """Continues the stream ``strm`` on ``src_len`` bytes at ``src`` until
    ``dst[0:dst_cap]`` is full, the stream ends, an error or no progress.

    Returns ``(consumed, produced, zlib code, crc)``: ``crc`` is the running
    CRC-32 updated with the produced bytes. Never writes past ``dst_cap``.
    """
    p = strm.ctypes.data
    consumed, produced, rc = _feed(p, strm, src, src_len, dst, dst_cap, True)
    if produced > 0:
        crc = zng_crc32_z(np.uint32(crc), dst, produced)
    return consumed, produced, rc, np.uint32(crc)


@njit(**KERNEL)
def inflate_close(strm):
    """Frees the zlib-ng state of a stream opened by :func:`inflate_open`."""
    return zng_inflateEnd(strm.ctypes.data)
