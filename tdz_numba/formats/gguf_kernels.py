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

from ..jit.presets import PARALLEL

__all__ = ["KERNELS", "half_table"]

_HALF: np.ndarray | None = None


def half_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (65536 entries, exact)."""
    global _HALF
    if _HALF is None:
        _HALF = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return _HALF


# Each kernel slices its block (``blk``) and its output (``dst``) once, so the inner
# loops index from 0 with loop-invariant shifts: no wraparound checks, vectorizable.


@njit(**PARALLEL)
def _q8_0(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 34 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 34 : b * 34 + 34]
        dst = out[b * 32 : b * 32 + 32]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        q = blk[2:34].view(np.int8)
        for j in range(32):
            dst[j] = np.float32(q[j]) * d
    return True


@njit(**PARALLEL)
def _q4_0(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 18 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 18 : b * 18 + 18]
        dst = out[b * 32 : b * 32 + 32]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        qs = blk[2:18]
        for j in range(16):
            dst[j] = d * np.float32(np.int32(qs[j] & 15) - 8)
        for j in range(16):
            dst[16 + j] = d * np.float32(np.int32(qs[j] >> 4) - 8)
    return True


@njit(**PARALLEL)
def _q4_1(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 20 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 20 : b * 20 + 20]
        dst = out[b * 32 : b * 32 + 32]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        m = half[np.int64(blk[2]) | (np.int64(blk[3]) << 8)]
        qs = blk[4:20]
        for j in range(16):
            dst[j] = d * np.float32(qs[j] & 15) + m
        for j in range(16):
            dst[16 + j] = d * np.float32(qs[j] >> 4) + m
    return True


@njit(**PARALLEL)
def _q5_0(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 22 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 22 : b * 22 + 22]
        dst = out[b * 32 : b * 32 + 32]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        qh = (
            np.uint32(blk[2])
            | (np.uint32(blk[3]) << 8)
            | (np.uint32(blk[4]) << 16)
            | (np.uint32(blk[5]) << 24)
        )
        qs = blk[6:22]
        for j in range(16):
            dst[j] = d * np.float32((np.int32(qs[j] & 15) | (np.int32((qh >> j) & 1) << 4)) - 16)
        for j in range(16):
            dst[16 + j] = d * np.float32((np.int32(qs[j] >> 4) | (np.int32((qh >> (j + 16)) & 1) << 4)) - 16)
    return True


@njit(**PARALLEL)
def _q5_1(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 32
    if raw.size != n * 24 or out.size != n * 32 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 24 : b * 24 + 24]
        dst = out[b * 32 : b * 32 + 32]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        m = half[np.int64(blk[2]) | (np.int64(blk[3]) << 8)]
        qh = (
            np.uint32(blk[4])
            | (np.uint32(blk[5]) << 8)
            | (np.uint32(blk[6]) << 16)
            | (np.uint32(blk[7]) << 24)
        )
        qs = blk[8:24]
        for j in range(16):
            dst[j] = d * np.float32(np.int32(qs[j] & 15) | (np.int32((qh >> j) & 1) << 4)) + m
        for j in range(16):
            dst[16 + j] = d * np.float32(np.int32(qs[j] >> 4) | (np.int32((qh >> (j + 16)) & 1) << 4)) + m
    return True


@njit(**PARALLEL)
def _q2_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 84 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 84 : b * 84 + 84]
        dst = out[b * 256 : b * 256 + 256]
        d = half[np.int64(blk[80]) | (np.int64(blk[81]) << 8)]
        dmin = half[np.int64(blk[82]) | (np.int64(blk[83]) << 8)]
        for k in range(16):
            sc = blk[k]
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            sh = 2 * ((k % 8) // 2)
            base = 16 + (k // 8) * 32 + (k % 2) * 16
            q = blk[base : base + 16]
            o = dst[k * 16 : k * 16 + 16]
            for e in range(16):
                o[e] = dl * np.float32((q[e] >> sh) & 3) - ml
    return True


@njit(**PARALLEL)
def _q3_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 110 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 110 : b * 110 + 110]
        dst = out[b * 256 : b * 256 + 256]
        d = half[np.int64(blk[108]) | (np.int64(blk[109]) << 8)]
        for k in range(16):
            lo = (blk[96 + (k % 8)] >> (4 * (k // 8))) & 15
            hi = (blk[104 + (k % 4)] >> (2 * (k // 4))) & 3
            dl = d * np.float32(np.int32(lo | (hi << 4)) - 32)
            sh = 2 * ((k % 8) // 2)
            base = 32 + (k // 8) * 32 + (k % 2) * 16
            q = blk[base : base + 16]
            hbit = (k * 16) // 32
            hm = blk[(k % 2) * 16 : (k % 2) * 16 + 16]  # hmask lanes of these 16 elements
            o = dst[k * 16 : k * 16 + 16]
            for e in range(16):
                ql = np.int32((q[e] >> sh) & 3)
                qh = np.int32(((hm[e] >> hbit) & 1) ^ 1)
                o[e] = dl * np.float32(ql - (qh << 2))
    return True


@njit(**PARALLEL)
def _q4_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 144 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 144 : b * 144 + 144]
        dst = out[b * 256 : b * 256 + 256]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        dmin = half[np.int64(blk[2]) | (np.int64(blk[3]) << 8)]
        for c in range(4):
            qs = blk[16 + c * 32 : 48 + c * 32]
            for h in range(2):
                j = 2 * c + h
                if j < 4:
                    sc = blk[4 + j] & 63
                    mn = blk[8 + j] & 63
                else:
                    sc = (blk[8 + j] & 15) | ((blk[j] >> 2) & 48)
                    mn = (blk[8 + j] >> 4) | ((blk[4 + j] >> 2) & 48)
                dd = d * np.float32(sc)
                dm = dmin * np.float32(mn)
                o = dst[j * 32 : j * 32 + 32]
                if h == 0:
                    for e in range(32):
                        o[e] = dd * np.float32(qs[e] & 15) - dm
                else:
                    for e in range(32):
                        o[e] = dd * np.float32(qs[e] >> 4) - dm
    return True


@njit(**PARALLEL)
def _q5_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 176 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 176 : b * 176 + 176]
        dst = out[b * 256 : b * 256 + 256]
        d = half[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
        dmin = half[np.int64(blk[2]) | (np.int64(blk[3]) << 8)]
        qh = blk[16:48]
        for c in range(4):
            qs = blk[48 + c * 32 : 80 + c * 32]
            for h in range(2):
                j = 2 * c + h
                if j < 4:
                    sc = blk[4 + j] & 63
                    mn = blk[8 + j] & 63
                else:
                    sc = (blk[8 + j] & 15) | ((blk[j] >> 2) & 48)
                    mn = (blk[8 + j] >> 4) | ((blk[4 + j] >> 2) & 48)
                dd = d * np.float32(sc)
                dm = dmin * np.float32(mn)
                o = dst[j * 32 : j * 32 + 32]
                sh = 4 * h
                for e in range(32):
                    q = ((qs[e] >> sh) & 15) | (((qh[e] >> j) & 1) << 4)
                    o[e] = dd * np.float32(q) - dm
    return True


@njit(**PARALLEL)
def _q6_k(raw, half, out):  # pragma: no cover - compiled
    n = out.size // 256
    if raw.size != n * 210 or out.size != n * 256 or half.size != 65536:
        return False
    for b in prange(n):
        blk = raw[b * 210 : b * 210 + 210]
        dst = out[b * 256 : b * 256 + 256]
        d = half[np.int64(blk[208]) | (np.int64(blk[209]) << 8)]
        sc = blk[192:208].view(np.int8)
        for k in range(16):
            ds = d * np.float32(sc[k])
            c = k // 8
            r0 = (k % 8) * 16  # position inside the 128-element half
            lsh = 4 * (r0 // 64)
            hsh = 2 * (r0 // 32)
            ql = blk[c * 64 + r0 % 64 : c * 64 + r0 % 64 + 16]
            qh = blk[128 + c * 32 + r0 % 32 : 128 + c * 32 + r0 % 32 + 16]
            o = dst[k * 16 : k * 16 + 16]
            for e in range(16):
                q = ((ql[e] >> lsh) & 15) | (((qh[e] >> hsh) & 3) << 4)
                o[e] = ds * np.float32(np.int32(q) - 32)
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
