"""Numba kernels for parallel raw deflate and inflate with zlib-ng.

A large entry is cut into independent *segments*. Each is deflated by its own
zlib-ng stream, ended with a full flush (the last one with ``Z_FINISH``), so
that the concatenation is ONE standard raw-deflate stream that ``unzip``,
:mod:`zipfile` and tensordict decode as usual, while tdz_numba, knowing the
segment boundaries, inflates every segment in parallel straight into the
leaf's preallocated output.

Kernels take arrays of addresses and lengths and return arrays of sizes, CRCs
and zlib status codes; the Python wrappers in :mod:`tdz_numba.codecs` check
them.

Examples
--------
>>> import numpy as np, zlib
>>> from tdz_numba import codec_kernels as ck
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

from ._jit import (
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

__all__ = ["deflate_bound", "deflate_segments", "inflate_segments", "Z_OK", "Z_STREAM_END"]

Z_OK = 0
Z_STREAM_END = 1
Z_FULL_FLUSH = 3
Z_FINISH = 4
_Z_DEFLATED = 8
#: zng_stream is 13 machine words on 64-bit platforms; fields used here:
_NEXT_IN, _AVAIL_IN, _TOTAL_IN, _NEXT_OUT, _AVAIL_OUT, _TOTAL_OUT = 0, 1, 2, 3, 4, 5
_STREAM_WORDS = 13
#: Largest segment: avail_in / avail_out are 32-bit in zng_stream.
MAX_SEGMENT = 1 << 30


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
        strm = np.zeros(_STREAM_WORDS, np.uint64)
        p = strm.ctypes.data
        rc = zng_deflateInit2(p, np.int32(level), np.int32(_Z_DEFLATED), np.int32(-15), np.int32(8), np.int32(0))
        if rc != Z_OK:
            status[i] = rc
            continue
        strm[_NEXT_IN] = src[i]
        strm[_AVAIL_IN] = src_len[i]
        strm[_NEXT_OUT] = dst[i]
        strm[_AVAIL_OUT] = dst_cap[i]
        flush = Z_FINISH if last[i] else Z_FULL_FLUSH
        rc = zng_deflate(p, np.int32(flush))
        done = strm[_AVAIL_IN] == 0 and (rc == Z_STREAM_END if last[i] else rc == Z_OK and strm[_AVAIL_OUT] > 0)
        status[i] = rc if done else -5  # Z_BUF_ERROR: the bound was too small
        out_len[i] = np.int64(strm[_TOTAL_OUT])
        zng_deflateEnd(p)
        crc[i] = zng_crc32_z(np.uint32(0), src[i], src_len[i])
        strm[0] = 0  # keep strm alive until here
    return out_len, crc, status


@njit(**PARALLEL)
def inflate_segments(src, src_len, dst, dst_len, last):
    """Inflates each raw-deflate segment ``src[i]`` into exactly ``dst_len[i]`` bytes at ``dst[i]``.

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
        strm = np.zeros(_STREAM_WORDS, np.uint64)
        p = strm.ctypes.data
        rc = zng_inflateInit2(p, np.int32(-15))
        if rc != Z_OK:
            status[i] = rc
            continue
        strm[_NEXT_IN] = src[i]
        strm[_AVAIL_IN] = src_len[i]
        strm[_NEXT_OUT] = dst[i]
        strm[_AVAIL_OUT] = dst_len[i]
        rc = zng_inflate(p, np.int32(Z_FINISH if last[i] else 2))  # Z_SYNC_FLUSH
        produced = np.int64(strm[_TOTAL_OUT])
        left = np.int64(strm[_AVAIL_IN])
        zng_inflateEnd(p)
        if rc < 0 and rc != -5:
            status[i] = rc
        elif produced < dst_len[i]:
            status[i] = 2
        elif left > 0:
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
