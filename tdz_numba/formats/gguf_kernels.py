"""Numba kernels that dequantize GGML blocks to float32.

Each kernel takes the raw blocks as a 1-D ``uint8`` array (``n_blocks *
type_size`` bytes, checked by the caller and again here), a float16 -> float32
lookup table and a preallocated 1-D ``float32`` output of ``n_blocks *
block_size`` elements, and decodes one block per ``prange`` iteration. The
arithmetic is the ``gguf`` package's (``gguf/quants.py``) operation for
operation (same products, same order, no fused multiply-add), so the results
match it bit for bit.

Block layouts (``d``/``dmin``/``m`` are little-endian float16):

=======  =====  ===========================================================
type     bytes  layout
=======  =====  ===========================================================
Q4_0     18     d, qs[16] (low nibbles: elements 0-15, high: 16-31)
Q4_1     20     d, m, qs[16]
Q5_0     22     d, qh (uint32: 5th bits), qs[16]
Q5_1     24     d, m, qh, qs[16]
Q8_0     34     d, qs[32] (int8)
Q2_K     84     scales[16], qs[64], d, dmin
Q3_K     110    hmask[32], qs[64], scales[12], d
Q4_K     144    d, dmin, scales[12] (6-bit scale/min pairs), qs[128]
Q5_K     176    d, dmin, scales[12], qh[32], qs[128]
Q6_K     210    ql[128], qh[64], scales[16] (int8), d
=======  =====  ===========================================================

Examples
--------
>>> import numpy as np
>>> from tdz_numba.formats.gguf_kernels import KERNELS, half_table
>>> kernel, block, size = KERNELS["Q8_0"]
>>> raw = np.zeros(size, np.uint8); raw[:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8); raw[2] = 4
>>> out = np.empty(block, np.float32); ok = kernel(raw, half_table(), out)
>>> float(out[0]), float(out[1])
(2.0, 0.0)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .._jit import PARALLEL

__all__ = ["KERNELS", "half_table"]

_HALF: np.ndarray | None = None


def half_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (65536 entries, exact)."""
    global _HALF
    if _HALF is None:
        _HALF = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return _HALF


@njit(**PARALLEL)
def _q8_0(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 34 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 34
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        o = b * 32
        for j in range(32):
            out[o + j] = np.float32(np.int8(raw[p + 2 + j])) * d
    return True


@njit(**PARALLEL)
def _q4_0(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 18 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 18
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        o = b * 32
        for j in range(16):
            q = raw[p + 2 + j]
            out[o + j] = d * np.float32(np.int32(q & 15) - 8)
            out[o + 16 + j] = d * np.float32(np.int32(q >> 4) - 8)
    return True


@njit(**PARALLEL)
def _q4_1(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 20 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 20
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        m = half[np.int64(raw[p + 2]) | (np.int64(raw[p + 3]) << 8)]
        o = b * 32
        for j in range(16):
            q = raw[p + 4 + j]
            out[o + j] = d * np.float32(q & 15) + m
            out[o + 16 + j] = d * np.float32(q >> 4) + m
    return True


@njit(**PARALLEL)
def _q5_0(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 22 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 22
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        qh = (np.uint32(raw[p + 2]) | (np.uint32(raw[p + 3]) << 8)
              | (np.uint32(raw[p + 4]) << 16) | (np.uint32(raw[p + 5]) << 24))  # fmt: skip
        o = b * 32
        for j in range(16):
            q = raw[p + 6 + j]
            lo = np.int32(q & 15) | (np.int32((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | (np.int32((qh >> (j + 16)) & 1) << 4)
            out[o + j] = d * np.float32(lo - 16)
            out[o + 16 + j] = d * np.float32(hi - 16)
    return True


@njit(**PARALLEL)
def _q5_1(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 24 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 24
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        m = half[np.int64(raw[p + 2]) | (np.int64(raw[p + 3]) << 8)]
        qh = (np.uint32(raw[p + 4]) | (np.uint32(raw[p + 5]) << 8)
              | (np.uint32(raw[p + 6]) << 16) | (np.uint32(raw[p + 7]) << 24))  # fmt: skip
        o = b * 32
        for j in range(16):
            q = raw[p + 8 + j]
            lo = np.int32(q & 15) | (np.int32((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | (np.int32((qh >> (j + 16)) & 1) << 4)
            out[o + j] = d * np.float32(lo) + m
            out[o + 16 + j] = d * np.float32(hi) + m
    return True


@njit(**PARALLEL)
def _q2_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 84 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 84
        d = half[np.int64(raw[p + 80]) | (np.int64(raw[p + 81]) << 8)]
        dmin = half[np.int64(raw[p + 82]) | (np.int64(raw[p + 83]) << 8)]
        o = b * 256
        for k in range(16):
            sc = raw[p + k]
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            c = k // 8
            sh = 2 * ((k % 8) // 2)
            base = p + 16 + c * 32 + (k % 2) * 16
            for e in range(16):
                q = (raw[base + e] >> sh) & 3
                out[o + k * 16 + e] = dl * np.float32(q) - ml
    return True


@njit(**PARALLEL)
def _q3_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 110 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 110
        d = half[np.int64(raw[p + 108]) | (np.int64(raw[p + 109]) << 8)]
        s = p + 96
        o = b * 256
        for k in range(16):
            lo = (raw[s + (k % 8)] >> (4 * (k // 8))) & 15
            hi = (raw[s + 8 + (k % 4)] >> (2 * (k // 4))) & 3
            dl = d * np.float32(np.int32(lo | (hi << 4)) - 32)
            c = k // 8
            sh = 2 * ((k % 8) // 2)
            base = p + 32 + c * 32 + (k % 2) * 16
            for e in range(16):
                pos = k * 16 + e
                lane = pos % 32
                ql = np.int32((raw[base + e] >> sh) & 3)
                qh = np.int32(((raw[p + lane] >> (pos // 32)) & 1) ^ 1)
                out[o + pos] = dl * np.float32(ql - (qh << 2))
    return True


@njit(**PARALLEL)
def _q4_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 144 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 144
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        dmin = half[np.int64(raw[p + 2]) | (np.int64(raw[p + 3]) << 8)]
        s = p + 4
        o = b * 256
        for c in range(4):
            for h in range(2):
                j = 2 * c + h
                if j < 4:
                    sc = raw[s + j] & 63
                    mn = raw[s + 4 + j] & 63
                else:
                    sc = (raw[s + 4 + j] & 15) | ((raw[s + j - 4] >> 2) & 48)
                    mn = (raw[s + 4 + j] >> 4) | ((raw[s + j] >> 2) & 48)
                dd = d * np.float32(sc)
                dm = dmin * np.float32(mn)
                q0 = p + 16 + c * 32
                sh = 4 * h
                for e in range(32):
                    out[o + j * 32 + e] = dd * np.float32((raw[q0 + e] >> sh) & 15) - dm
    return True


@njit(**PARALLEL)
def _q5_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 176 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 176
        d = half[np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)]
        dmin = half[np.int64(raw[p + 2]) | (np.int64(raw[p + 3]) << 8)]
        s = p + 4
        o = b * 256
        for c in range(4):
            for h in range(2):
                j = 2 * c + h
                if j < 4:
                    sc = raw[s + j] & 63
                    mn = raw[s + 4 + j] & 63
                else:
                    sc = (raw[s + 4 + j] & 15) | ((raw[s + j - 4] >> 2) & 48)
                    mn = (raw[s + 4 + j] >> 4) | ((raw[s + j] >> 2) & 48)
                dd = d * np.float32(sc)
                dm = dmin * np.float32(mn)
                q0 = p + 48 + c * 32
                sh = 4 * h
                for e in range(32):
                    q = ((raw[q0 + e] >> sh) & 15) | (((raw[p + 16 + e] >> j) & 1) << 4)
                    out[o + j * 32 + e] = dd * np.float32(q) - dm
    return True


@njit(**PARALLEL)
def _q6_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 210 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        p = b * 210
        d = half[np.int64(raw[p + 208]) | (np.int64(raw[p + 209]) << 8)]
        o = b * 256
        for k in range(16):
            ds = d * np.float32(np.int8(raw[p + 192 + k]))
            for e in range(16):
                pos = k * 16 + e
                c = pos // 128
                r = pos % 128
                lo = (raw[p + c * 64 + r % 64] >> (4 * (r // 64))) & 15
                hi = (raw[p + 128 + c * 32 + r % 32] >> (2 * (r // 32))) & 3
                out[o + pos] = ds * np.float32(np.int32(lo | (hi << 4)) - 32)
    return True


@njit(**PARALLEL)
def _f16(raw, half, out):  # pragma: no cover - compiled
    n = out.size
    if raw.size != n * 2 or half.size != 65536:
        return False
    for i in prange(n):
        out[i] = half[np.int64(raw[2 * i]) | (np.int64(raw[2 * i + 1]) << 8)]
    return True


@njit(**PARALLEL)
def _bf16(raw, half, bits):  # pragma: no cover - compiled
    # ``bits`` is the float32 output viewed as uint32 by the caller
    n = bits.size
    if raw.size != n * 2:
        return False
    for i in prange(n):
        bits[i] = (np.uint32(raw[2 * i]) << 16) | (np.uint32(raw[2 * i + 1]) << 24)
    return True


#: ggml type name -> (kernel, elements per block, bytes per block)
KERNELS = {
    "Q4_0": (_q4_0, 32, 18),
    "Q4_1": (_q4_1, 32, 20),
    "Q5_0": (_q5_0, 32, 22),
    "Q5_1": (_q5_1, 32, 24),
    "Q8_0": (_q8_0, 32, 34),
    "Q2_K": (_q2_k, 256, 84),
    "Q3_K": (_q3_k, 256, 110),
    "Q4_K": (_q4_k, 256, 144),
    "Q5_K": (_q5_k, 256, 176),
    "Q6_K": (_q6_k, 256, 210),
    "F16": (_f16, 1, 2),
    "BF16": (_bf16, 1, 2),
}
