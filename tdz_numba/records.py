"""Zip records: the byte layout of local headers, central records and end records.

Only fixed-size packing and unpacking lives here; offsets are planned by
:mod:`tdz_numba.layout` and the whole central directory is parsed by
:func:`tdz_numba.kernels.parse_central_directory`. The records match what
Python's :mod:`zipfile` writes for tensordict 0.15.3 with ``force_zip64=True``
(version 45, a zip64 extra on every local header, a ``0x6474`` padding block
before it on aligned entries), so our archives differ from tensordict's only
in their timestamps.

Examples
--------
>>> from tdz_numba import records
>>> len(records.local_header(b"a.memmap", crc=0, size=4, csize=4, method=0,
...                          dos=(0, 33), pad=None))
58
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np

from .errors import BadArchiveError, UnsupportedError

__all__ = [
    "ALIGNMENT",
    "PAD_EXTRA_ID",
    "STORED",
    "DEFLATED",
    "BZIP2",
    "LZMA",
    "METHOD_NAMES",
    "dos_datetime",
    "version_needed",
    "name_flags",
    "local_header",
    "local_headers",
    "central_header",
    "central_directory",
    "end_records",
    "EndRecord",
    "find_end_record",
]

#: Payload alignment of ``*.memmap`` entries (tensordict's ``_ALIGNMENT``).
ALIGNMENT = 64
#: Id of the padding extra block (``b"td"`` little-endian).
PAD_EXTRA_ID = 0x6474
ZIP64_EXTRA_ID = 0x0001

STORED, DEFLATED, BZIP2, LZMA = 0, 8, 12, 14
METHOD_NAMES = {STORED: "stored", DEFLATED: "deflate", BZIP2: "bzip2", LZMA: "lzma"}

LOCAL_SIG = 0x04034B50
CENTRAL_SIG = 0x02014B50
END_SIG = b"PK\x05\x06"
ZIP64_END_SIG = b"PK\x06\x06"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
DESCRIPTOR_SIG = b"PK\x07\x08"

FLAG_ENCRYPTED = 0x1
FLAG_DESCRIPTOR = 0x8
FLAG_UTF8 = 0x800
_FLAG_LZMA_EOS = 0x2

_END = struct.Struct("<4sHHHHIIH")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_CREATE_SYSTEM_UNIX = 3
_EXTERNAL_ATTR = 0o644 << 16


def dos_datetime(timestamp: float | None = None) -> tuple[int, int]:
    """DOS ``(time, date)`` of a local time, as zipfile stamps entries."""
    t = time.localtime(timestamp)
    year = max(t.tm_year, 1980)
    return (
        t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2,
        (year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday,
    )


def version_needed(method: int) -> int:
    """"Version needed to extract": 45 (zip64), 46 for bzip2, 63 for lzma."""
    return {BZIP2: 46, LZMA: 63}.get(method, 45)


def name_flags(name: str, method: int) -> tuple[bytes, int]:
    """Encoded name and general-purpose flags (UTF-8 bit only when needed)."""
    flags = _FLAG_LZMA_EOS if method == LZMA else 0
    try:
        return name.encode("ascii"), flags
    except UnicodeEncodeError:
        return name.encode("utf-8"), flags | FLAG_UTF8


_LOCAL_DT = np.dtype([("sig", "<u4"), ("version", "<u2"), ("flags", "<u2"), ("method", "<u2"),
                      ("time", "<u2"), ("date", "<u2"), ("crc", "<u4"), ("csize", "<u4"),
                      ("size", "<u4"), ("name_len", "<u2"), ("extra_len", "<u2")])  # fmt: skip
_CENTRAL_DT = np.dtype([("sig", "<u4"), ("made_by", "<u2"), ("version", "<u2"), ("flags", "<u2"),
                        ("method", "<u2"), ("time", "<u2"), ("date", "<u2"), ("crc", "<u4"),
                        ("csize", "<u4"), ("size", "<u4"), ("name_len", "<u2"), ("extra_len", "<u2"),
                        ("comment_len", "<u2"), ("disk", "<u2"), ("internal", "<u2"),
                        ("external", "<u4"), ("header_offset", "<u4")])  # fmt: skip
_ZIP64_LOCAL_DT = np.dtype([("id", "<u2"), ("len", "<u2"), ("size", "<u8"), ("csize", "<u8")])
_PAD_DT = np.dtype([("id", "<u2"), ("len", "<u2")])
assert _LOCAL_DT.itemsize == 30 and _CENTRAL_DT.itemsize == 46 and _ZIP64_LOCAL_DT.itemsize == 20


def _versions(methods: np.ndarray) -> np.ndarray:
    out = np.full(methods.shape, 45, np.int64)
    out[methods == BZIP2] = 46
    out[methods == LZMA] = 63
    return out


def _pad_blocks(pads: np.ndarray) -> list[bytes]:
    """Padding extra blocks (``None`` pad, encoded as -1: no block)."""
    heads = np.zeros(pads.size, _PAD_DT)
    heads["id"] = PAD_EXTRA_ID
    heads["len"] = np.maximum(pads, 0)
    raw = heads.tobytes()
    return [b"" if p < 0 else raw[4 * i : 4 * i + 4] + bytes(p) for i, p in enumerate(pads.tolist())]


def local_headers(names: list[bytes], *, crc, size, csize, method, dos: tuple[int, int], pad,
                  flags, more: list[bytes] | None = None) -> list[bytes]:  # fmt: skip
    """Local file headers (with name and extra field) of many entries at once.

    Array arguments are per entry; ``pad`` is the payload padding, -1 for
    entries without a padding block. Sizes go in the zip64 extra, the 32-bit
    fields hold ``0xFFFFFFFF``. ``more`` are extra blocks placed first (the
    segment tables of compressed entries).
    """
    n = len(names)
    more = [b""] * n if more is None else more
    method = np.asarray(method, np.int64).reshape(n)
    pad = np.asarray(pad, np.int64).reshape(n)
    fixed = np.zeros(n, _LOCAL_DT)
    fixed["sig"] = LOCAL_SIG
    fixed["version"] = _versions(method)
    fixed["flags"] = np.asarray(flags, np.int64).reshape(n)
    fixed["method"] = method
    fixed["time"], fixed["date"] = dos
    fixed["crc"] = np.asarray(crc, np.int64).reshape(n)
    fixed["csize"] = fixed["size"] = 0xFFFFFFFF
    fixed["name_len"] = [len(b) for b in names]
    fixed["extra_len"] = np.where(pad >= 0, 4 + pad, 0) + _ZIP64_LOCAL_DT.itemsize + [len(m) for m in more]
    z64 = np.zeros(n, _ZIP64_LOCAL_DT)
    z64["id"], z64["len"] = ZIP64_EXTRA_ID, 16
    z64["size"] = np.asarray(size, np.int64).reshape(n)
    z64["csize"] = np.asarray(csize, np.int64).reshape(n)
    fb, zb = fixed.tobytes(), z64.tobytes()
    pads = _pad_blocks(pad)
    return [fb[30 * i : 30 * i + 30] + names[i] + more[i] + pads[i] + zb[20 * i : 20 * i + 20]
            for i in range(n)]  # fmt: skip


def central_directory(names: list[bytes], *, crc, size, csize, method, dos: tuple[int, int], pad,
                      flags, header_offset) -> bytes:  # fmt: skip
    """The central directory records of many entries, as one bytes object.

    zip64 fields are used where zipfile uses them: sizes or offsets above
    ``2**31 - 1``; the padding block of aligned entries is copied after them.
    """
    from .kernels import ZIP64_LIMIT

    n = len(names)
    method = np.asarray(method, np.int64).reshape(n)
    size = np.asarray(size, np.int64).reshape(n)
    csize = np.asarray(csize, np.int64).reshape(n)
    hoff = np.asarray(header_offset, np.int64).reshape(n)
    pad = np.asarray(pad, np.int64).reshape(n)
    big_size = (size > ZIP64_LIMIT) | (csize > ZIP64_LIMIT)
    big_off = hoff > ZIP64_LIMIT
    z64 = [b""] * n
    for i in np.nonzero(big_size | big_off)[0].tolist():
        values = ([int(size[i]), int(csize[i])] if big_size[i] else []) + ([int(hoff[i])] if big_off[i] else [])
        z64[i] = struct.pack(f"<HH{len(values)}Q", ZIP64_EXTRA_ID, 8 * len(values), *values)
    pads = _pad_blocks(pad)
    version = _versions(method)
    fixed = np.zeros(n, _CENTRAL_DT)
    fixed["sig"] = CENTRAL_SIG
    fixed["made_by"] = version | (_CREATE_SYSTEM_UNIX << 8)
    fixed["version"] = version
    fixed["flags"] = np.asarray(flags, np.int64).reshape(n)
    fixed["method"] = method
    fixed["time"], fixed["date"] = dos
    fixed["crc"] = np.asarray(crc, np.int64).reshape(n)
    fixed["csize"] = np.where(big_size, 0xFFFFFFFF, csize)
    fixed["size"] = np.where(big_size, 0xFFFFFFFF, size)
    fixed["name_len"] = [len(b) for b in names]
    fixed["extra_len"] = [len(a) + len(b) for a, b in zip(z64, pads)]
    fixed["external"] = _EXTERNAL_ATTR
    fixed["header_offset"] = np.where(big_off, 0xFFFFFFFF, hoff)
    fb = fixed.tobytes()
    return b"".join(fb[46 * i : 46 * i + 46] + names[i] + z64[i] + pads[i] for i in range(n))


def local_header(name: bytes, *, crc: int, size: int, csize: int, method: int,
                 dos: tuple[int, int], pad: int | None, flags: int = 0) -> bytes:  # fmt: skip
    """One local file header; ``pad`` is the payload padding (None: no padding block)."""
    return local_headers([name], crc=[crc], size=[size], csize=[csize], method=[method], dos=dos,
                         pad=[-1 if pad is None else pad], flags=[flags])[0]  # fmt: skip


def central_header(name: bytes, *, crc: int, size: int, csize: int, method: int,
                   dos: tuple[int, int], pad: int | None, header_offset: int, flags: int = 0) -> bytes:  # fmt: skip
    """One central directory record (see :func:`central_directory`)."""
    return central_directory([name], crc=[crc], size=[size], csize=[csize], method=[method], dos=dos,
                             pad=[-1 if pad is None else pad], flags=[flags],
                             header_offset=[header_offset])  # fmt: skip


def end_records(count: int, cd_offset: int, cd_size: int, zip64: bool) -> bytes:
    """The end-of-central-directory record, preceded by the zip64 end records
    when ``zip64``."""
    out = b""
    if zip64:
        out += _ZIP64_END.pack(
            ZIP64_END_SIG, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset
        )
        out += _ZIP64_LOCATOR.pack(ZIP64_LOCATOR_SIG, 0, cd_offset + cd_size, 1)
        count = min(count, 0xFFFF)
        cd_size = min(cd_size, 0xFFFFFFFF)
        cd_offset = min(cd_offset, 0xFFFFFFFF)
    return out + _END.pack(END_SIG, 0, 0, count, count, cd_size, cd_offset, 0)


@dataclass(frozen=True)
class EndRecord:
    """Where the central directory is: from the (zip64) end records."""

    count: int
    cd_offset: int
    cd_size: int
    end_offset: int  # offset of the end-of-central-directory record
    zip64: bool


def find_end_record(buf, name: str = "archive") -> EndRecord:
    """Finds and validates the end records in ``buf`` (bytes-like, the whole file).

    Raises
    ------
    BadArchiveError
        No end record, a truncated file, counts or offsets that point outside
        the file.
    UnsupportedError
        A multi-disk (spanned) archive.
    """
    size = len(buf)
    if size < _END.size:
        raise BadArchiveError(
            f"{name}: not a zip archive: {size} bytes, shorter than the "
            f"{_END.size}-byte end-of-central-directory record"
        )
    lo = max(0, size - (_END.size + 0xFFFF))
    tail = bytes(buf[lo:size])
    pos = tail.rfind(END_SIG)
    while pos >= 0:
        # the comment length must reach exactly to the end of the file
        if pos + _END.size <= len(tail):
            comment_len = struct.unpack_from("<H", tail, pos + 20)[0]
            if pos + _END.size + comment_len == len(tail):
                break
        pos = tail.rfind(END_SIG, 0, pos)
    if pos < 0:
        raise BadArchiveError(
            f"{name}: no end-of-central-directory record (signature PK\\5\\6) in "
            f"the last {len(tail)} bytes: not a zip archive, or truncated"
        )
    end_offset = lo + pos
    _, disk, cd_disk, n_disk, count, cd_size, cd_offset, _ = _END.unpack_from(tail, pos)
    zip64 = False
    loc = end_offset - _ZIP64_LOCATOR.size
    if loc >= 0 and bytes(buf[loc : loc + 4]) == ZIP64_LOCATOR_SIG:
        _, z_disk, z_end, n_disks = _ZIP64_LOCATOR.unpack_from(bytes(buf[loc:end_offset]))
        if z_end + _ZIP64_END.size > loc or z_end < 0:
            raise BadArchiveError(
                f"{name}: the zip64 end locator at offset {loc} points to offset "
                f"{z_end}, outside the file (expected < {loc - _ZIP64_END.size + 1})"
            )
        rec = bytes(buf[z_end : z_end + _ZIP64_END.size])
        if rec[:4] != ZIP64_END_SIG:
            raise BadArchiveError(
                f"{name}: no zip64 end record at offset {z_end} "
                f"(expected signature PK\\6\\6, found {rec[:4]!r})"
            )
        (_, _, _, _, disk, cd_disk, n_disk, count, cd_size, cd_offset) = _ZIP64_END.unpack(rec)
        zip64 = True
        if n_disks > 1:
            disk = 1
        end_offset = z_end
    if disk != 0 or cd_disk != 0 or n_disk != count:
        raise UnsupportedError(f"{name}: multi-disk (spanned) zip archives are not supported")
    if cd_offset + cd_size > end_offset:
        raise BadArchiveError(
            f"{name}: the central directory at offset {cd_offset} with {cd_size} "
            f"bytes runs past its end record at offset {end_offset} (file truncated?)"
        )
    if count * 46 > cd_size:
        raise BadArchiveError(
            f"{name}: the end record lists {count} entries but the central "
            f"directory has only {cd_size} bytes (expected >= {count * 46})"
        )
    return EndRecord(count, cd_offset, cd_size, end_offset, zip64)
