"""Slow oracle: GGML dequantization transcribed element by element from ggml's C reference
(``dequantize_row_*`` in ggml-quants.c), with float32 scalar arithmetic in the C evaluation
order. Independent of both the kernels and the gguf package's vectorized numpy code."""

from __future__ import annotations

import numpy as np

__all__ = ["naive_dequantize", "NAIVE_TYPES"]

F = np.float32


def _half(b: bytes | np.ndarray, off: int) -> np.float32:
    return F(np.frombuffer(bytes(b[off : off + 2]), "<f2")[0])


def _i8(v: int) -> int:
    return v - 256 if v >= 128 else v


def _q4_0(b, y):
    d = _half(b, 0)
    for j in range(16):
        y.append(F(int(b[2 + j] & 0x0F) - 8) * d)
    for j in range(16):
        y.append(F(int(b[2 + j] >> 4) - 8) * d)


def _q4_1(b, y):
    d, m = _half(b, 0), _half(b, 2)
    lo = [F(int(b[4 + j] & 0x0F)) * d + m for j in range(16)]
    hi = [F(int(b[4 + j] >> 4)) * d + m for j in range(16)]
    y.extend(lo + hi)


def _q5(b, y, with_min):
    d = _half(b, 0)
    m = _half(b, 2) if with_min else None
    p = 4 if with_min else 2
    qh = int.from_bytes(bytes(b[p : p + 4]), "little")
    qs = b[p + 4 : p + 20]
    lo, hi = [], []
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        x0 = (int(qs[j]) & 0x0F) | xh0
        x1 = (int(qs[j]) >> 4) | xh1
        if with_min:
            lo.append(F(x0) * d + m)
            hi.append(F(x1) * d + m)
        else:
            lo.append(F(x0 - 16) * d)
            hi.append(F(x1 - 16) * d)
    y.extend(lo + hi)


def _q8_0(b, y):
    d = _half(b, 0)
    for j in range(32):
        y.append(F(_i8(int(b[2 + j]))) * d)


def _q2_k(b, y):
    scales, q, d, dmin = b[0:16], b[16:80], _half(b, 80), _half(b, 82)
    is_ = 0
    for n in range(2):
        qq = q[n * 32 : n * 32 + 32]
        shift = 0
        for _ in range(4):
            for half in range(2):
                sc = int(scales[is_])
                is_ += 1
                dl, ml = d * F(sc & 0xF), dmin * F(sc >> 4)
                for j in range(16):
                    y.append(dl * F((int(qq[j + 16 * half]) >> shift) & 3) - ml)
            shift += 2


def _q3_k(b, y):
    hm, q, raw_scales, d_all = b[0:32], b[32:96], bytes(b[96:108]), _half(b, 108)
    aux = [int.from_bytes(raw_scales[4 * i : 4 * i + 4], "little") for i in range(3)] + [0]
    k1, k2 = 0x03030303, 0x0F0F0F0F
    tmp = aux[2]
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
    scales = [_i8(v) for v in b"".join(a.to_bytes(4, "little") for a in aux)]
    is_, m = 0, 1
    for n in range(2):
        qq = q[n * 32 : n * 32 + 32]
        shift = 0
        for _ in range(4):
            for half in range(2):
                dl = d_all * F(scales[is_] - 32)
                is_ += 1
                for j in range(16):
                    lane = j + 16 * half
                    v = ((int(qq[lane]) >> shift) & 3) - (0 if int(hm[lane]) & m else 4)
                    y.append(dl * F(v))
            shift += 2
            m <<= 1


def _scale_min_k4(j, s):
    if j < 4:
        return int(s[j]) & 63, int(s[j + 4]) & 63
    return (int(s[j + 4]) & 0xF) | ((int(s[j - 4]) >> 6) << 4), (int(s[j + 4]) >> 4) | ((int(s[j]) >> 6) << 4)


def _q45_k(b, y, five):
    d, dmin, scales = _half(b, 0), _half(b, 2), b[4:16]
    qh = b[16:48] if five else None
    ql = b[48:176] if five else b[16:144]
    u1, u2 = 1, 2
    for n in range(4):
        sc1, m1 = _scale_min_k4(2 * n, scales)
        sc2, m2 = _scale_min_k4(2 * n + 1, scales)
        d1, mm1, d2, mm2 = d * F(sc1), dmin * F(m1), d * F(sc2), dmin * F(m2)
        q = ql[32 * n : 32 * n + 32]
        for j in range(32):
            v = (int(q[j]) & 0xF) + ((16 if int(qh[j]) & u1 else 0) if five else 0)
            y.append(d1 * F(v) - mm1)
        for j in range(32):
            v = (int(q[j]) >> 4) + ((16 if int(qh[j]) & u2 else 0) if five else 0)
            y.append(d2 * F(v) - mm2)
        u1 <<= 2
        u2 <<= 2


def _q6_k(b, y):
    ql, qh, sc, d = b[0:128], b[128:192], [_i8(int(v)) for v in b[192:208]], _half(b, 208)
    out = [F(0)] * 256
    for n in range(2):
        L, H, S, base = ql[64 * n :], qh[32 * n :], sc[8 * n :], 128 * n
        for j in range(32):
            is_ = j // 16
            q1 = _i8(((int(L[j]) & 0xF) | (((int(H[j]) >> 0) & 3) << 4)) & 0xFF) - 32
            q2 = _i8(((int(L[j + 32]) & 0xF) | (((int(H[j]) >> 2) & 3) << 4)) & 0xFF) - 32
            q3 = _i8(((int(L[j]) >> 4) | (((int(H[j]) >> 4) & 3) << 4)) & 0xFF) - 32
            q4 = _i8(((int(L[j + 32]) >> 4) | (((int(H[j]) >> 6) & 3) << 4)) & 0xFF) - 32
            out[base + j] = d * F(S[is_]) * F(q1)
            out[base + j + 32] = d * F(S[is_ + 2]) * F(q2)
            out[base + j + 64] = d * F(S[is_ + 4]) * F(q3)
            out[base + j + 96] = d * F(S[is_ + 6]) * F(q4)
    y.extend(out)


_DECODERS = {
    "Q4_0": (_q4_0, 18),
    "Q4_1": (_q4_1, 20),
    "Q5_0": (lambda b, y: _q5(b, y, False), 22),
    "Q5_1": (lambda b, y: _q5(b, y, True), 24),
    "Q8_0": (_q8_0, 34),
    "Q2_K": (_q2_k, 84),
    "Q3_K": (_q3_k, 110),
    "Q4_K": (lambda b, y: _q45_k(b, y, False), 144),
    "Q5_K": (lambda b, y: _q45_k(b, y, True), 176),
    "Q6_K": (_q6_k, 210),
}
NAIVE_TYPES = tuple(_DECODERS)


def naive_dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    """float32 values of the blocks in ``raw`` (1-D uint8, whole blocks)."""
    fn, size = _DECODERS[name]
    raw = np.asarray(raw, np.uint8).reshape(-1)
    assert raw.size % size == 0
    y: list[np.float32] = []
    with np.errstate(all="ignore"):
        for i in range(raw.size // size):
            fn(raw[i * size : (i + 1) * size], y)
    return np.array(y, dtype=np.float32)
