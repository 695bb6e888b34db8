"""Slow, obvious oracles of every kernel and packer of the zip format.

Each function does one thing the plainest way (``zlib``, ``struct``, a Python
loop, one entry at a time, as zipfile and tensordict's writer do), with its
own literal offsets: it shares no code with tdz_numba, so agreement means
something. Used by test_kernels.py, test_records.py and test_index.py.
"""

from __future__ import annotations

import struct
import zlib

ZIP64_LIMIT = (1 << 31) - 1
MAX_U16 = 0xFFFF


# ------------------------------------------------------------------ CRC-32 ----
def crc32(data: bytes, start: int = 0) -> int:
    return zlib.crc32(data, start)


def crc32_zeros(n: int) -> int:
    return zlib.crc32(bytes(n))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)``, ``len(B)``, by linearity:
    feed ``len2`` zero bytes after ``A``, cancel the zeros' own contribution, add ``B``'s."""
    zeros = bytes(len2)
    return zlib.crc32(zeros, crc1) ^ zlib.crc32(zeros) ^ crc2


def table_crc32(data: bytes, crc: int = 0) -> int:
    """Bit-by-bit reflected CRC-32 (polynomial 0xEDB88320)."""
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


# ------------------------------------------------------------------ layout ----
def naive_zip64_fields(size: int, csize: int, header_offset: int) -> int:
    """zipfile's ``ZipFile._write_end_record`` rule: bit 1 sizes, bit 2 offset."""
    bits = 0
    if size > ZIP64_LIMIT or csize > ZIP64_LIMIT:
        bits |= 1
    if header_offset > ZIP64_LIMIT:
        bits |= 2
    return bits


def naive_plan(name_len, sizes, align, local_more=None):
    """Per entry ``(header_offset, pad or -1, payload_offset)``, then the end of the data:
    a local header is 30 + name + other extras + [4 + pad] + 20 (zip64 extra). The
    extra field (other extras + 4 + pad + 20) holds at most 65,535 bytes: when the
    padding would not fit, the header starts later by the excess (a gap)."""
    pos, out = 0, []
    local_more = local_more or [0] * len(name_len)
    for n, s, a, more in zip(name_len, sizes, align, local_more):
        pad = -1
        if a > 1:
            fixed_extra = more + 4 + 20
            while True:  # one byte at a time: the slow, obvious search for a header start that fits
                base = pos + 30 + n + fixed_extra
                pad = -base % a
                if fixed_extra + pad <= 0xFFFF:
                    break
                pos += 1
            base += pad
        else:
            base = pos + 30 + n + more + 20
        out.append((pos, pad, base))
        pos = base + s
    return out, pos


def _version(method: int) -> int:
    return {12: 46, 14: 63}.get(method, 45)


def naive_local_header(name: bytes, *, crc, size, csize, method, dos, pad, flags, more=b"") -> bytes:
    extra = more
    if pad is not None:
        extra += struct.pack("<HH", 0x6474, pad) + bytes(pad)
    extra += struct.pack("<HHQQ", 1, 16, size, csize)
    return (
        struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            _version(method),
            flags,
            method,
            dos[0],
            dos[1],
            crc,
            0xFFFFFFFF,
            0xFFFFFFFF,
            len(name),
            len(extra),
        )
        + name
        + extra
    )


def naive_central_record(name: bytes, *, crc, size, csize, method, dos, pad, flags, header_offset) -> bytes:
    bits = naive_zip64_fields(size, csize, header_offset)
    values = ([size, csize] if bits & 1 else []) + ([header_offset] if bits & 2 else [])
    extra = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) if values else b""
    if pad is not None:
        extra += struct.pack("<HH", 0x6474, pad) + bytes(pad)
    v = _version(method)
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            v | 3 << 8,
            v,
            flags,
            method,
            dos[0],
            dos[1],
            crc,
            0xFFFFFFFF if bits & 1 else csize,
            0xFFFFFFFF if bits & 1 else size,
            len(name),
            len(extra),
            0,
            0,
            0,
            0o644 << 16,
            0xFFFFFFFF if bits & 2 else header_offset,
        )
        + name
        + extra
    )


def naive_end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    out = b""
    if count > MAX_U16 or cd_offset > ZIP64_LIMIT or cd_size > ZIP64_LIMIT:
        out = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<4sIQI", b"PK\x06\x07", 0, cd_offset + cd_size, 1)
        count, cd_size, cd_offset = min(count, MAX_U16), min(cd_size, 0xFFFFFFFF), min(cd_offset, 0xFFFFFFFF)
    return out + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_offset, 0)


def naive_archive(names, payloads, align, *, dos=(0, 33), methods=None) -> bytes:
    """A whole STORED archive written one entry at a time, as tensordict's writer does."""
    methods = methods or [0] * len(names)
    out, central = b"", b""
    for name, data, a, m in zip(names, payloads, align, methods):
        raw = name.encode("ascii") if name.isascii() else name.encode("utf-8")
        flags = 0 if name.isascii() else 0x800
        pad = None
        if a > 1:
            pad = -(len(out) + 30 + len(raw) + 4 + 20) % a
        kw = dict(
            crc=zlib.crc32(data), size=len(data), csize=len(data), method=m, dos=dos, pad=pad, flags=flags
        )
        # tensordict copies its 64-byte padding block into the central record; page paddings stay local
        central += naive_central_record(
            raw, header_offset=len(out), **{**kw, "pad": pad if a == 64 else None}
        )
        out += naive_local_header(raw, **kw) + data
    return out + central + naive_end_records(len(names), len(out), len(central))


# ------------------------------------------------------------------- index ----
def naive_index(buf: bytes, check_local: bool):
    """Rows of ``(name, flags, method, crc, csize, size, header_offset, payload_offset,
    local_extra_len)`` parsed with struct (payload/extra -1 without ``check_local``);
    raises ValueError for anything out of bounds (a much simpler, stricter walk)."""
    eocd = buf.rfind(b"PK\x05\x06")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<4sHHHHIIH", buf, eocd)
    if buf[eocd - 20 : eocd - 16] == b"PK\x06\x07":
        (z,) = struct.unpack_from("<Q", buf, eocd - 12)
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", buf, z + 32)
    rows, p = [], cd_offset
    for _ in range(count):
        (sig, _, _, flags, method, _, _, crc, csize, size, nlen, elen, clen, _, _, _, hoff) = (
            struct.unpack_from("<IHHHHHHIIIHHHHHII", buf, p)
        )
        if sig != 0x02014B50:
            raise ValueError("central signature")
        name = buf[p + 46 : p + 46 + nlen]
        extra = buf[p + 46 + nlen : p + 46 + nlen + elen]
        q = 0
        while q + 4 <= len(extra):
            tag, ln = struct.unpack_from("<HH", extra, q)
            if tag == 1:
                vals = list(struct.unpack_from(f"<{ln // 8}Q", extra, q + 4))
                if size == 0xFFFFFFFF:
                    size = vals.pop(0)
                if csize == 0xFFFFFFFF:
                    csize = vals.pop(0)
                if hoff == 0xFFFFFFFF:
                    hoff = vals.pop(0)
            q += 4 + ln
        payload = lelen = -1
        if check_local:
            lsig, lnlen, lelen = struct.unpack_from("<I22xHH", buf, hoff)
            if lsig != 0x04034B50 or buf[hoff + 30 : hoff + 30 + lnlen] != name:
                raise ValueError("local header")
            payload = hoff + 30 + lnlen + lelen
            if payload + csize > cd_offset:
                raise ValueError("payload past the central directory")
        rows.append((name, flags, method, crc, csize, size, hoff, payload, lelen))
        p += 46 + nlen + elen + clen
    return rows
