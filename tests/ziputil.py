"""The tests' one hand-written zip parser (independent of tdz_numba.zipfmt.records and of zipfile).

``parse_zip`` walks the end record (and the zip64 end record when the plain one is saturated), every central
record and the local header it points to; ``payload_offset`` reads one local header; ``zero_timestamps``
compares archives apart from their DOS timestamps. Tests that corrupt archives, look for extra blocks or check
payload alignment use these instead of parsing records themselves. ``rewrite`` (through zipfile) makes an
edited copy of an archive: entries replaced, dropped or added.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

__all__ = ["Record", "ParsedZip", "parse_zip", "payload_offset", "zero_timestamps", "rewrite", "zip_bytes"]

LOCAL_SIG, CENTRAL_SIG, EOCD_SIG, ZIP64_EOCD_SIG = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06"


class Record(NamedTuple):
    """One entry, as its central record and local header describe it."""

    name: str
    cpos: int  # offset of the central record
    clen: int  # length of the central record with its name, extra field and comment
    hoff: int  # offset of the local header
    payload: int  # payload offset (local header + its name + its extra field)
    method: int
    crc: int
    csize: int  # zip64 values resolved
    usize: int
    local_extra: int  # offset of the local header's extra field
    local_extra_len: int


class ParsedZip(NamedTuple):
    eocd: int  # offset of the plain end record
    count: int
    cd_off: int
    cd_size: int
    records: list[Record]


def payload_offset(data: bytes | bytearray, hoff: int) -> int:
    """The payload offset of the entry whose local header is at ``hoff``."""
    assert data[hoff : hoff + 4] == LOCAL_SIG, f"bad local header at {hoff}"
    name_len, extra_len = struct.unpack_from("<HH", data, hoff + 26)
    return hoff + 30 + name_len + extra_len


def parse_zip(data: bytes | bytearray) -> ParsedZip:
    """Every record of a (zip64 or not) archive, checked for signatures and for a contiguous central directory."""
    eocd = bytes(data).rfind(EOCD_SIG)
    assert eocd >= 0, "no end of central directory record"
    count, cd_size, cd_off = struct.unpack_from("<HII", data, eocd + 10)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF:
        z64 = bytes(data).rfind(ZIP64_EOCD_SIG, 0, eocd)
        assert z64 >= 0, "saturated end record without a zip64 end record"
        count, cd_size, cd_off = struct.unpack_from("<QQQ", data, z64 + 32)
    records = []
    p = cd_off
    for _ in range(count):
        assert data[p : p + 4] == CENTRAL_SIG, f"bad central record at {p}"
        method, _time, _date, crc, csize, usize, name_len, extra_len, comment_len = struct.unpack_from(
            "<HHHIIIHHH", data, p + 10
        )
        hoff = struct.unpack_from("<I", data, p + 42)[0]
        q, end = p + 46 + name_len, p + 46 + name_len + extra_len
        while q + 4 <= end:  # the zip64 block holds the saturated fields, in this order
            hid, hlen = struct.unpack_from("<HH", data, q)
            if hid == 1:
                k = q + 4
                values = {"usize": usize, "csize": csize, "hoff": hoff}
                for field, value in values.items():
                    if value == 0xFFFFFFFF:
                        values[field] = struct.unpack_from("<Q", data, k)[0]
                        k += 8
                usize, csize, hoff = values["usize"], values["csize"], values["hoff"]
            q += 4 + hlen
        name = bytes(data[p + 46 : p + 46 + name_len]).decode("utf-8")
        clen = 46 + name_len + extra_len + comment_len
        payload = payload_offset(data, hoff)
        local_name_len, local_extra_len = struct.unpack_from("<HH", data, hoff + 26)
        records.append(
            Record(
                name,
                p,
                clen,
                hoff,
                payload,
                method,
                crc,
                csize,
                usize,
                hoff + 30 + local_name_len,
                local_extra_len,
            )
        )
        p += clen
    assert p == cd_off + cd_size, f"central directory ends at {p}, recorded {cd_off + cd_size}"
    return ParsedZip(eocd, count, cd_off, cd_size, records)


def zero_timestamps(data: bytes) -> bytes:
    """``data`` with the DOS time/date of every local header (bytes 10..13) and
    central record (bytes 12..15) zeroed."""
    b = bytearray(data)
    for r in parse_zip(b).records:
        b[r.cpos + 12 : r.cpos + 16] = bytes(4)
        b[r.hoff + 10 : r.hoff + 14] = bytes(4)
    return bytes(b)


def rewrite(
    src: Path,
    dst: Path,
    edit: Callable[[str, bytes], bytes | None] = lambda name, data: data,
    add: Iterable[tuple[str, bytes]] = (),
) -> Path:
    """A zipfile-written copy of ``src`` at ``dst``: ``edit(name, data)`` gives each entry's
    new bytes (None drops the entry), then the ``add`` entries ``(name, data)`` are appended."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info, data)
        for name, data in add:
            zout.writestr(name, data)
    return Path(dst)


def zip_bytes(entries: dict[str, bytes], **kw) -> bytes:
    """A zip archive of ``entries`` (name -> bytes) written by the stdlib ``zipfile``
    (``kw``: its options, e.g. ``compression``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", **kw) as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buf.getvalue()
