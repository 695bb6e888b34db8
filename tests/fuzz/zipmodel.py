"""A lenient, independent zip parser for the fuzz harness: where every field is.

:func:`field_map` lists every fixed field of every record (EOCD, zip64 end
record and locator, central records, local headers, extra blocks including
the zip64 extra, tensordict's ``0x6474`` padding and our ``0x7A74`` segment
table, data descriptors) with its offset and width, so that mutators can aim
at fields instead of random bytes. :func:`entries` / :func:`rebuild` split an
archive into entries and write it back with one entry's bytes replaced,
keeping 64-byte alignment of everything after it. Nothing here uses
tdz_numba: the harness must not share the parser it tests.

Examples
--------
>>> import io, zipfile
>>> buf = io.BytesIO()
>>> with zipfile.ZipFile(buf, "w") as z:
...     z.writestr("meta.json", "{}")
>>> sorted({f.record for f in field_map(buf.getvalue())})
['central', 'eocd', 'local']
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

__all__ = ["Field", "field_map", "Member", "entries", "rebuild", "normalize_times", "to_zip64"]

_EOCD = [
    ("sig", 4),
    ("disk", 2),
    ("cd_disk", 2),
    ("n_disk", 2),
    ("count", 2),
    ("cd_size", 4),
    ("cd_offset", 4),
    ("comment_len", 2),
]
_Z64END = [
    ("sig", 4),
    ("rec_size", 8),
    ("ver_made", 2),
    ("ver_need", 2),
    ("disk", 4),
    ("cd_disk", 4),
    ("n_disk", 8),
    ("count", 8),
    ("cd_size", 8),
    ("cd_offset", 8),
]
_LOCATOR = [("sig", 4), ("disk", 4), ("z64_end", 8), ("n_disks", 4)]
_CENTRAL = [
    ("sig", 4),
    ("ver_made", 2),
    ("ver_need", 2),
    ("flags", 2),
    ("method", 2),
    ("time", 2),
    ("date", 2),
    ("crc", 4),
    ("csize", 4),
    ("size", 4),
    ("name_len", 2),
    ("extra_len", 2),
    ("comment_len", 2),
    ("disk", 2),
    ("int_attr", 2),
    ("ext_attr", 4),
    ("hoff", 4),
]
_LOCAL = [
    ("sig", 4),
    ("ver_need", 2),
    ("flags", 2),
    ("method", 2),
    ("time", 2),
    ("date", 2),
    ("crc", 4),
    ("csize", 4),
    ("size", 4),
    ("name_len", 2),
    ("extra_len", 2),
]


@dataclass(frozen=True)
class Field:
    """One field: ``record`` kind, ``index`` of the record, ``name``, ``offset``, ``width``
    (bytes; 0 < width <= 8 for integers, ``kind == "bytes"`` for names and payloads)."""

    record: str
    index: int
    name: str
    offset: int
    width: int
    kind: str = "int"


def _fields(out: list[Field], record: str, index: int, layout, base: int, size: int) -> int:
    pos = base
    for name, width in layout:
        if pos + width > size:
            break
        out.append(Field(record, index, name, pos, width))
        pos += width
    return pos


def _extras(out: list[Field], buf: bytes, record: str, index: int, start: int, end: int) -> dict[int, int]:
    """Fields of the extra blocks in ``buf[start:end]``; returns ``{block id: data offset}``."""
    found: dict[int, int] = {}
    pos = start
    while pos + 4 <= end:
        hid, hlen = struct.unpack_from("<HH", buf, pos)
        out.append(Field(record, index, f"extra_id_{hid:#06x}", pos, 2))
        out.append(Field(record, index, f"extra_len_{hid:#06x}", pos + 2, 2))
        data = pos + 4
        stop = min(data + hlen, end)
        found.setdefault(hid, data)
        if hid == 0x0001:
            for k, q in enumerate(range(data, stop - 7, 8)):
                out.append(Field(record, index, f"zip64_{k}", q, 8))
        elif hid == 0x7A74 and stop - data >= 16:
            out.append(Field(record, index, "seg_version", data, 4))
            out.append(Field(record, index, "seg_size", data + 4, 8))
            out.append(Field(record, index, "seg_count", data + 12, 4))
            for k, q in enumerate(range(data + 16, stop - 3, 4)):
                out.append(Field(record, index, f"seg_clen_{k}", q, 4))
        elif hid == 0x6474:
            out.append(Field(record, index, "pad_data", data, max(stop - data, 0), "bytes"))
        pos = data + hlen
    return found


def _end(buf: bytes) -> tuple[int, int, int, int] | None:
    """``(eocd offset, count, cd offset, cd size)`` (zip64 values where present)."""
    pos = buf.rfind(b"PK\x05\x06")
    if pos < 0 or pos + 22 > len(buf):
        return None
    count, cd_size, cd_off = struct.unpack_from("<HII", buf, pos + 10)
    loc = pos - 20
    if loc >= 0 and buf[loc : loc + 4] == b"PK\x06\x07":
        z = struct.unpack_from("<Q", buf, loc + 8)[0]
        if 0 <= z and z + 56 <= len(buf) and buf[z : z + 4] == b"PK\x06\x06":
            count, cd_size, cd_off = struct.unpack_from("<QQQ", buf, z + 32)
    return pos, count, cd_off, cd_size


def field_map(buf: bytes) -> list[Field]:
    """Every field of every record found in ``buf`` (a best effort on damaged input)."""
    out: list[Field] = []
    size = len(buf)
    end = _end(buf)
    if end is None:
        return out
    eocd, count, cd_off, _ = end
    _fields(out, "eocd", 0, _EOCD, eocd, size)
    out.append(Field("eocd", 0, "comment", eocd + 22, size - eocd - 22, "bytes"))
    loc = eocd - 20
    if loc >= 0 and buf[loc : loc + 4] == b"PK\x06\x07":
        _fields(out, "locator", 0, _LOCATOR, loc, size)
        z = struct.unpack_from("<Q", buf, loc + 8)[0]
        if z + 56 <= size and buf[z : z + 4] == b"PK\x06\x06":
            _fields(out, "zip64_end", 0, _Z64END, z, size)
    pos = cd_off
    for i in range(min(count, 100_000)):
        if pos + 46 > size or buf[pos : pos + 4] != b"PK\x01\x02":
            break
        _fields(out, "central", i, _CENTRAL, pos, size)
        flags, method = struct.unpack_from("<HH", buf, pos + 8)
        csize, usize = struct.unpack_from("<II", buf, pos + 20)
        nlen, elen, clen = struct.unpack_from("<HHH", buf, pos + 28)
        hoff = struct.unpack_from("<I", buf, pos + 42)[0]
        out.append(Field("central", i, "name", pos + 46, nlen, "bytes"))
        ex = _extras(out, buf, "central", i, pos + 46 + nlen, min(pos + 46 + nlen + elen, size))
        if 0x0001 in ex:  # zip64 values replace the 0xFFFFFFFF fields, in order
            q = ex[0x0001]
            vals = []
            for flag in (usize, csize, hoff):
                if flag == 0xFFFFFFFF and q + 8 <= size:
                    vals.append(struct.unpack_from("<Q", buf, q)[0])
                    q += 8
                else:
                    vals.append(flag)
            usize, csize, hoff = vals
        pos += 46 + nlen + elen + clen
        _local(out, buf, i, hoff, flags, method, csize)
    return out


def _local(out: list[Field], buf: bytes, i: int, hoff: int, flags: int, method: int, csize: int) -> None:
    size = len(buf)
    if hoff + 30 > size or buf[hoff : hoff + 4] != b"PK\x03\x04":
        return
    _fields(out, "local", i, _LOCAL, hoff, size)
    nlen, elen = struct.unpack_from("<HH", buf, hoff + 26)
    out.append(Field("local", i, "name", hoff + 30, nlen, "bytes"))
    _extras(out, buf, "local", i, hoff + 30 + nlen, min(hoff + 30 + nlen + elen, size))
    data = hoff + 30 + nlen + elen
    if data + csize <= size:
        out.append(Field("data", i, "payload", data, csize, "bytes"))
        if flags & 0x8:
            d = data + csize
            if buf[d : d + 4] == b"PK\x07\x08":
                out.append(Field("descriptor", i, "sig", d, 4))
                d += 4
            for name, width in (("crc", 4), ("csize", 4), ("size", 4)):
                if d + width <= size:
                    out.append(Field("descriptor", i, name, d, width))
                d += width


# ---------------------------------------------------------------------------
# Entries and rebuilding (for meta.json mutations)
# ---------------------------------------------------------------------------
@dataclass
class Member:
    """One entry as raw pieces: local header + extra (rewritten on rebuild), data, central record."""

    name: bytes
    local_fixed: bytes  # 30 bytes
    local_extra: bytes
    data: bytes
    descriptor: bytes
    central_fixed: bytes  # 46 bytes
    central_extra: bytes
    comment: bytes
    hoff: int = 0
    extras: dict = field(default_factory=dict)


def entries(buf: bytes) -> list[Member]:
    """The entries of a well-formed archive (the seeds), in central-directory order."""
    end = _end(buf)
    assert end is not None, "no end record"
    _, count, pos, _ = end
    out = []
    for _ in range(count):
        assert buf[pos : pos + 4] == b"PK\x01\x02"
        cfixed = buf[pos : pos + 46]
        flags = struct.unpack_from("<H", cfixed, 8)[0]
        csize, usize = struct.unpack_from("<II", cfixed, 20)
        nlen, elen, clen = struct.unpack_from("<HHH", cfixed, 28)
        hoff = struct.unpack_from("<I", cfixed, 42)[0]
        name = buf[pos + 46 : pos + 46 + nlen]
        cextra = buf[pos + 46 + nlen : pos + 46 + nlen + elen]
        comment = buf[pos + 46 + nlen + elen : pos + 46 + nlen + elen + clen]
        z = _zip64_values(cextra, usize, csize, hoff)
        usize, csize, hoff = z
        lfixed = buf[hoff : hoff + 30]
        lnlen, lelen = struct.unpack_from("<HH", lfixed, 26)
        lextra = buf[hoff + 30 + lnlen : hoff + 30 + lnlen + lelen]
        d = hoff + 30 + lnlen + lelen
        data = buf[d : d + csize]
        desc = b""
        if flags & 0x8:
            q = d + csize
            n = 16 if buf[q : q + 4] == b"PK\x07\x08" else 12
            desc = buf[q : q + n]
        out.append(Member(name, lfixed, lextra, data, desc, cfixed, cextra, comment, hoff))
        pos += 46 + nlen + elen + clen
    return out


def _zip64_values(extra: bytes, usize: int, csize: int, hoff: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, pos)
        if hid == 1:
            q = pos + 4
            vals = []
            for v in (usize, csize, hoff):
                if v == 0xFFFFFFFF:
                    vals.append(struct.unpack_from("<Q", extra, q)[0])
                    q += 8
                else:
                    vals.append(v)
            return vals[0], vals[1], vals[2]
        pos += 4 + hlen
    return usize, csize, hoff


def _set_local_sizes(lfixed: bytes, lextra: bytes, crc: int, size: int) -> tuple[bytes, bytes]:
    """A STORED entry's local header with a new CRC and size (in the zip64 extra too)."""
    f = bytearray(lfixed)
    struct.pack_into("<I", f, 14, crc)
    e = bytearray(lextra)
    pos = 0
    z64 = None
    while pos + 4 <= len(e):
        hid, hlen = struct.unpack_from("<HH", e, pos)
        if hid == 1 and hlen >= 16:
            z64 = pos + 4
        pos += 4 + hlen
    if z64 is not None and struct.unpack_from("<I", f, 22)[0] == 0xFFFFFFFF:
        struct.pack_into("<QQ", e, z64, size, size)
    else:
        struct.pack_into("<II", f, 18, size, size)
    return bytes(f), bytes(e)


def rebuild(
    members: list[Member],
    *,
    replace: dict[bytes, bytes] | None = None,
    extra_members: list[tuple[bytes, bytes]] = (),
) -> bytes:
    """The archive of ``members`` with the STORED entries named in ``replace`` given new
    bytes (CRC and sizes updated), plus ``extra_members`` (name, bytes) appended STORED.

    Replacement data is padded with spaces (valid after JSON) so that every later
    offset moves by a multiple of 64: aligned payloads stay aligned.
    """
    replace = dict(replace or {})
    out = bytearray()
    central = bytearray()
    count = 0
    rows = [(m, replace.get(m.name)) for m in members]
    for name, data in extra_members:
        lfixed = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0)
        cfixed = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            20,
            20,
            0,
            0,
            0,
            0x21,
            0,
            0,
            0,
            len(name),
            0,
            0,
            0,
            0,
            0o644 << 16,
            0,
        )
        rows.append((Member(name, lfixed, b"", b"", b"", cfixed, b"", b""), data))
    for m, new in rows:
        hoff = len(out)
        lfixed, lextra, data = m.local_fixed, m.local_extra, m.data
        cfixed = bytearray(m.central_fixed)
        cextra = m.central_extra
        if new is not None:
            delta = len(new) - len(data)
            if delta % 64 and m.name.endswith(b"meta.json"):
                new = new + b" " * ((-delta) % 64)
            data = new
            crc = zlib.crc32(data)
            lfixed, lextra = _set_local_sizes(lfixed, lextra, crc, len(data))
            struct.pack_into("<I", cfixed, 16, crc)
            if struct.unpack_from("<I", cfixed, 20)[0] != 0xFFFFFFFF:
                struct.pack_into("<II", cfixed, 20, len(data), len(data))
        out += lfixed + m.name + lextra + data + m.descriptor
        ho = struct.unpack_from("<I", cfixed, 42)[0]
        if ho == 0xFFFFFFFF:
            cextra = _set_central_hoff(cextra, hoff, cfixed)
        else:
            struct.pack_into("<I", cfixed, 42, hoff)
        central += bytes(cfixed) + m.name + cextra + m.comment
        count += 1
    cd_off = len(out)
    out += central
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(central), cd_off, 0)
    return bytes(out)


def _set_central_hoff(cextra: bytes, hoff: int, cfixed: bytearray) -> bytes:
    e = bytearray(cextra)
    csize, usize = struct.unpack_from("<II", cfixed, 20)
    pos = 0
    while pos + 4 <= len(e):
        hid, hlen = struct.unpack_from("<HH", e, pos)
        if hid == 1:
            q = pos + 4 + (8 if usize == 0xFFFFFFFF else 0) + (8 if csize == 0xFFFFFFFF else 0)
            struct.pack_into("<Q", e, q, hoff)
        pos += 4 + hlen
    return bytes(e)


def normalize_times(buf: bytes) -> bytes:
    """``buf`` with every DOS time/date set to 1980-01-01 (deterministic seeds)."""
    b = bytearray(buf)
    for f in field_map(buf):
        if f.record in ("local", "central") and f.name in ("time", "date"):
            struct.pack_into("<H", b, f.offset, 0 if f.name == "time" else 0x21)
    return bytes(b)


def to_zip64(buf: bytes) -> bytes:
    """``buf`` rewritten with zip64 fields everywhere: 0xFFFFFFFF sizes and offsets in
    every central record (values in a zip64 extra) and zip64 end records."""
    members = entries(buf)
    out = bytearray()
    central = bytearray()
    for m in members:
        hoff = len(out)
        out += m.local_fixed + m.name + m.local_extra + m.data + m.descriptor
        c = bytearray(m.central_fixed)
        csize, usize = struct.unpack_from("<II", c, 20)
        usize, csize, _ = _zip64_values(m.central_extra, usize, csize, 0)
        # drop any zip64 block, then add ours
        kept = bytearray()
        pos = 0
        while pos + 4 <= len(m.central_extra):
            hid, hlen = struct.unpack_from("<HH", m.central_extra, pos)
            if hid != 1:
                kept += m.central_extra[pos : pos + 4 + hlen]
            pos += 4 + hlen
        z = struct.pack("<HHQQQ", 1, 24, usize, csize, hoff)
        struct.pack_into("<IIHH", c, 20, 0xFFFFFFFF, 0xFFFFFFFF, len(m.name), len(kept) + len(z))
        struct.pack_into("<I", c, 42, 0xFFFFFFFF)
        struct.pack_into("<H", c, 6, 45)
        central += bytes(c) + m.name + bytes(kept) + z + m.comment
    cd_off = len(out)
    out += central
    z64 = len(out)
    n = len(members)
    out += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(central), cd_off)
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, z64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return bytes(out)
