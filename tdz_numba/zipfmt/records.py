"""The zip format, described once: every record's layout, the zip64 rules, the packers.

Each record has one structured numpy dtype (``LOCAL_DT``, ``CENTRAL_DT``, ...),
its signature, and an :class:`~enum.IntEnum` of named field offsets with its
size as ``SIZEOF`` (:class:`Local`, :class:`Central`, ...): Python code packs
and unpacks through the dtypes, Numba kernels read fields at the offsets
(plain ``int`` constants). No other module spells an offset or a record size.

One function decides where zip64 fields go (:func:`central_zip64`) and one
computes every record length (:func:`local_header_len`,
:func:`central_record_len`); the layout plan (:mod:`tdz_numba.zipfmt.layout`) calls
them and hands the decisions to the packers (:func:`local_headers`,
:func:`central_directory`), which never decide again.

The records match what Python's :mod:`zipfile` writes for tensordict 0.15.3
with ``force_zip64=True`` (version 45, a zip64 extra on every local header, a
``0x6474`` padding block before it on aligned entries), so our archives
differ from tensordict's only in their timestamps.

Examples
--------
>>> from tdz_numba.zipfmt import records
>>> int(records.Central.HEADER_OFFSET), records.LOCAL_DT.itemsize
(42, 30)
>>> records.central_zip64([10, 3 << 30], [10, 1 << 20], [0, 5 << 30]).tolist()
[0, 3]
"""

from __future__ import annotations

import struct
import time
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from ..errors import BadArchiveError, InternalError, UnsupportedError

__all__ = [
    "ALIGNMENT",
    "PAD_EXTRA_ID",
    "ZIP64_EXTRA_ID",
    "SEGMENT_EXTRA_ID",
    "STORED",
    "DEFLATED",
    "BZIP2",
    "LZMA",
    "METHOD_NAMES",
    "FLAG_ENCRYPTED",
    "FLAG_DESCRIPTOR",
    "FLAG_UTF8",
    "ZIP64_LIMIT",
    "ZIP_COUNT_LIMIT",
    "MAX_NAME_DEPTH",
    "LOCAL_SIG",
    "CENTRAL_SIG",
    "END_SIG",
    "ZIP64_END_SIG",
    "ZIP64_LOCATOR_SIG",
    "DESCRIPTOR_SIG",
    "Local",
    "Central",
    "Extra",
    "Zip64Local",
    "End",
    "Zip64End",
    "Zip64Locator",
    "Descriptor",
    "Pad",
    "SegmentTable",
    "LOCAL_DT",
    "CENTRAL_DT",
    "EXTRA_DT",
    "ZIP64_LOCAL_DT",
    "END_DT",
    "ZIP64_END_DT",
    "ZIP64_LOCATOR_DT",
    "DESCRIPTOR_DT",
    "SEGMENT_TABLE_DT",
    "Col",
    "INDEX_DTYPE",
    "IndexRow",
    "Status",
    "ZIP64_SIZES",
    "ZIP64_OFFSET",
    "central_zip64",
    "local_header_len",
    "central_record_len",
    "needs_zip64_end",
    "end_records_len",
    "dos_datetime",
    "name_flags",
    "local_headers",
    "central_directory",
    "end_records",
    "EndRecord",
    "find_end_record",
    "central_directory_fits",
    "LOCAL_STRUCT",
    "END_STRUCT",
    "read_record",
    "end_record_position",
]

#: Payload alignment of ``*.memmap`` entries (tensordict's ``_ALIGNMENT``).
ALIGNMENT = 64
#: Id of the padding extra block (``b"td"`` little-endian).
PAD_EXTRA_ID = 0x6474
ZIP64_EXTRA_ID = 0x0001
#: Id of our segment-table extra block of deflated entries (``b"tz"``).
SEGMENT_EXTRA_ID = 0x7A74

STORED, DEFLATED, BZIP2, LZMA = 0, 8, 12, 14
METHOD_NAMES = {STORED: "stored", DEFLATED: "deflate", BZIP2: "bzip2", LZMA: "lzma"}

#: zipfile's (and so tensordict's) threshold for zip64 fields: 2 GiB - 1.
ZIP64_LIMIT = (1 << 31) - 1
#: More entries than this need the zip64 end records.
ZIP_COUNT_LIMIT = (1 << 16) - 1
#: The most ``/``-separated components an entry name may have (a reader limit:
#: deeper names are refused as a bad archive; nested levels in a tree are far fewer).
MAX_NAME_DEPTH = 4096

FLAG_ENCRYPTED = 0x1
FLAG_DESCRIPTOR = 0x8
FLAG_UTF8 = 0x800
_FLAG_LZMA_EOS = 0x2
_CREATE_SYSTEM_UNIX = 3
_EXTERNAL_ATTR = 0o644 << 16
_ZIP64_VERSION = 45


# ---------------------------------------------------------------------------
# Records: a dtype, a signature, a size and named field offsets each
# ---------------------------------------------------------------------------
LOCAL_SIG = 0x04034B50
CENTRAL_SIG = 0x02014B50
END_SIG = b"PK\x05\x06"
ZIP64_END_SIG = b"PK\x06\x06"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
DESCRIPTOR_SIG = b"PK\x07\x08"


class Local(IntEnum):
    """Local file header (``PK\\3\\4``): 30 bytes, then the name and the extra field."""

    SIG = 0
    VERSION = 4
    FLAGS = 6
    METHOD = 8
    TIME = 10
    DATE = 12
    CRC = 14
    CSIZE = 18
    SIZE = 22
    NAME_LEN = 26
    EXTRA_LEN = 28
    SIZEOF = 30


class Central(IntEnum):
    """Central directory record (``PK\\1\\2``): 46 bytes, then name, extra, comment."""

    SIG = 0
    MADE_BY = 4
    VERSION = 6
    FLAGS = 8
    METHOD = 10
    TIME = 12
    DATE = 14
    CRC = 16
    CSIZE = 20
    SIZE = 24
    NAME_LEN = 28
    EXTRA_LEN = 30
    COMMENT_LEN = 32
    DISK = 34
    INTERNAL = 36
    EXTERNAL = 38
    HEADER_OFFSET = 42
    SIZEOF = 46


class Extra(IntEnum):
    """Header of any extra block: id, data length; the data follows."""

    ID = 0
    LEN = 2
    SIZEOF = 4


class Zip64Local(IntEnum):
    """Our local zip64 extra (id 0x0001): both sizes, always present (20 bytes).
    The central one holds only the 8-byte values :func:`central_zip64` asks for,
    in the order size, compressed size, header offset."""

    ID = 0
    LEN = 2
    SIZE = 4
    CSIZE = 12
    SIZEOF = 20


class End(IntEnum):
    """End-of-central-directory record (``PK\\5\\6``): 22 bytes, then a comment."""

    SIG = 0
    DISK = 4
    CD_DISK = 6
    DISK_COUNT = 8
    COUNT = 10
    CD_SIZE = 12
    CD_OFFSET = 16
    COMMENT_LEN = 20
    SIZEOF = 22


class Zip64End(IntEnum):
    """zip64 end-of-central-directory record (``PK\\6\\6``): 56 bytes."""

    SIG = 0
    RECORD_SIZE = 4  # bytes after this field and the signature: 44
    MADE_BY = 12
    VERSION = 14
    DISK = 16
    CD_DISK = 20
    DISK_COUNT = 24
    COUNT = 32
    CD_SIZE = 40
    CD_OFFSET = 48
    SIZEOF = 56


class Zip64Locator(IntEnum):
    """zip64 end locator (``PK\\6\\7``): 20 bytes, just before the end record."""

    SIG = 0
    DISK = 4
    END_OFFSET = 8
    DISKS = 16
    SIZEOF = 20


class Descriptor(IntEnum):
    """Data descriptor, after its optional ``PK\\7\\8`` signature (32-bit sizes;
    zip64 ones are 8 bytes each)."""

    CRC = 0
    CSIZE = 4
    SIZE = 8
    SIZEOF = 12


class Pad(IntEnum):
    """Our ``0x6474`` padding block: id, length, then that many zero bytes."""

    ID = 0
    LEN = 2
    SIZEOF = 4


class SegmentTable(IntEnum):
    """Our ``0x7A74`` segment table of deflated entries: id, length, version,
    segment size, count, then ``count`` uint32 compressed segment lengths."""

    ID = 0
    LEN = 2
    VERSION = 4
    SEGMENT = 8
    COUNT = 16
    SIZEOF = 20


LOCAL_DT = np.dtype(
    [
        ("sig", "<u4"),
        ("version", "<u2"),
        ("flags", "<u2"),
        ("method", "<u2"),
        ("time", "<u2"),
        ("date", "<u2"),
        ("crc", "<u4"),
        ("csize", "<u4"),
        ("size", "<u4"),
        ("name_len", "<u2"),
        ("extra_len", "<u2"),
    ]
)
CENTRAL_DT = np.dtype(
    [
        ("sig", "<u4"),
        ("made_by", "<u2"),
        ("version", "<u2"),
        ("flags", "<u2"),
        ("method", "<u2"),
        ("time", "<u2"),
        ("date", "<u2"),
        ("crc", "<u4"),
        ("csize", "<u4"),
        ("size", "<u4"),
        ("name_len", "<u2"),
        ("extra_len", "<u2"),
        ("comment_len", "<u2"),
        ("disk", "<u2"),
        ("internal", "<u2"),
        ("external", "<u4"),
        ("header_offset", "<u4"),
    ]
)
EXTRA_DT = np.dtype([("id", "<u2"), ("len", "<u2")])
ZIP64_LOCAL_DT = np.dtype([("id", "<u2"), ("len", "<u2"), ("size", "<u8"), ("csize", "<u8")])
END_DT = np.dtype(
    [
        ("sig", "S4"),
        ("disk", "<u2"),
        ("cd_disk", "<u2"),
        ("disk_count", "<u2"),
        ("count", "<u2"),
        ("cd_size", "<u4"),
        ("cd_offset", "<u4"),
        ("comment_len", "<u2"),
    ]
)
ZIP64_END_DT = np.dtype(
    [
        ("sig", "S4"),
        ("record_size", "<u8"),
        ("made_by", "<u2"),
        ("version", "<u2"),
        ("disk", "<u4"),
        ("cd_disk", "<u4"),
        ("disk_count", "<u8"),
        ("count", "<u8"),
        ("cd_size", "<u8"),
        ("cd_offset", "<u8"),
    ]
)
ZIP64_LOCATOR_DT = np.dtype([("sig", "S4"), ("disk", "<u4"), ("end_offset", "<u8"), ("disks", "<u4")])
DESCRIPTOR_DT = np.dtype([("crc", "<u4"), ("csize", "<u4"), ("size", "<u4")])
SEGMENT_TABLE_DT = np.dtype(
    [("id", "<u2"), ("len", "<u2"), ("version", "<u4"), ("segment", "<u8"), ("count", "<u4")]
)
_PAD_DT = EXTRA_DT


def _check_described(fields: type[IntEnum], dtype: np.dtype) -> None:
    """A record's IntEnum and its dtype agree on every offset and on the size."""
    for name in dtype.names or ():
        if dtype.fields[name][1] != fields[name.upper()]:  # type: ignore[index]
            raise InternalError(f"records.{fields.__name__}.{name.upper()} disagrees with its dtype")
    if fields["SIZEOF"] != dtype.itemsize:
        raise InternalError(f"records.{fields.__name__}.SIZEOF disagrees with its dtype")


for _f, _d in (
    (Local, LOCAL_DT),
    (Central, CENTRAL_DT),
    (Extra, EXTRA_DT),
    (Zip64Local, ZIP64_LOCAL_DT),
    (End, END_DT),
    (Zip64End, ZIP64_END_DT),
    (Zip64Locator, ZIP64_LOCATOR_DT),
    (Descriptor, DESCRIPTOR_DT),
    (Pad, _PAD_DT),
    (SegmentTable, SEGMENT_TABLE_DT),
):
    _check_described(_f, _d)


# ---------------------------------------------------------------------------
# The reader's index of the central directory
# ---------------------------------------------------------------------------
class Col(IntEnum):
    """Columns of the index built by :func:`tdz_numba.zipfmt.kernels.crc.parse_central_directory`
    (an int64 array ``(count, len(Col))``; ``ArchiveIndex.table`` is the same
    memory as a structured array with the lower-case names, :data:`INDEX_DTYPE`)."""

    FLAGS = 0  # general-purpose flags
    METHOD = 1  # compression method
    CRC = 2  # CRC-32 of the uncompressed bytes
    CSIZE = 3  # stored (compressed) size
    SIZE = 4  # uncompressed size
    HEADER_OFFSET = 5  # offset of the local header
    NAME_OFFSET = 6  # offset of the name (in the central record)
    NAME_LEN = 7  # encoded name length
    PAYLOAD_OFFSET = 8  # offset of the stored bytes (-1: local header not read yet)
    CENTRAL_OFFSET = 9  # offset of the central record
    DOS_TIME = 10
    DOS_DATE = 11
    LOCAL_EXTRA_LEN = 12  # local extra field length (-1: local header not read yet)
    NEXT_OFFSET = 13  # where the next record starts: the next local header, or the central directory


#: The index as a structured array: one int64 field per :class:`Col`.
INDEX_DTYPE = np.dtype([(c.name.lower(), "<i8") for c in Col])


class IndexRow(NamedTuple):
    """One row of the index as Python ints (fields named like :class:`Col`)."""

    flags: int
    method: int
    crc: int
    csize: int
    size: int
    header_offset: int
    name_offset: int
    name_len: int
    payload_offset: int
    central_offset: int
    dos_time: int
    dos_date: int
    local_extra_len: int
    next_offset: int


if IndexRow._fields != INDEX_DTYPE.names:
    raise InternalError("records.IndexRow disagrees with records.Col")


class Status(IntEnum):
    """Status codes of the index kernels: ``status = [code, entry, expected, found]``."""

    OK = 0
    CENTRAL_SIGNATURE = 1  # a central record does not start with PK\1\2
    CENTRAL_OVERRUN = 2  # a central record runs past the central directory
    ZIP64_EXTRA = 3  # a 0xFFFFFFFF field without its zip64 extra value
    HEADER_PAST_END = 4  # a local header offset outside the data area
    LOCAL_SIGNATURE = 5  # the local header does not start with PK\3\4
    NAME_MISMATCH = 6  # local and central names differ
    PAYLOAD_PAST_END = 7  # the payload runs into the central directory
    OVERLAP = 8  # two entries' records overlap
    COUNT = 9  # the central directory holds another number of records than the end record says
    SIZE_RANGE = 10  # a size >= 2**63
    STORED_SIZE = 11  # a STORED entry whose size differs from its stored size


# ---------------------------------------------------------------------------
# zip64 decisions and record lengths (the layout plan and the packers share them)
# ---------------------------------------------------------------------------
#: :func:`central_zip64` bit: both sizes go in the central zip64 extra.
ZIP64_SIZES = 1
#: :func:`central_zip64` bit: the local header offset goes in the central zip64 extra.
ZIP64_OFFSET = 2


def central_zip64(size, csize, header_offset) -> np.ndarray:
    """Which central fields of each entry move to its zip64 extra (zipfile's rule).

    Bit :data:`ZIP64_SIZES` when the size or the compressed size exceeds
    :data:`ZIP64_LIMIT` (both sizes then move), bit :data:`ZIP64_OFFSET`
    when the local header offset does.
    """
    size = np.asarray(size, np.int64).reshape(-1)
    csize = np.asarray(csize, np.int64).reshape(-1)
    hoff = np.asarray(header_offset, np.int64).reshape(-1)
    big = (size > ZIP64_LIMIT) | (csize > ZIP64_LIMIT)
    return np.where(big, ZIP64_SIZES, 0) | np.where(hoff > ZIP64_LIMIT, ZIP64_OFFSET, 0)


def _central_zip64_len(zip64: np.ndarray) -> np.ndarray:
    values = np.where(zip64 & ZIP64_SIZES, 2, 0) + np.where(zip64 & ZIP64_OFFSET, 1, 0)
    return np.where(values > 0, Extra.SIZEOF + 8 * values, 0)


def _pad_len(pad: np.ndarray) -> np.ndarray:
    """Bytes of the padding blocks (``pad`` -1: no block)."""
    return np.where(pad >= 0, Pad.SIZEOF + np.maximum(pad, 0), 0)


def local_header_len(name_len, more_len, has_pad) -> np.ndarray:
    """Length of each local header *without* its padding bytes: fixed part,
    name, other extra blocks (``more_len``), the padding block's header when
    ``has_pad``, and the zip64 extra. The payload follows after the padding."""
    name_len = np.asarray(name_len, np.int64).reshape(-1)
    return (
        Local.SIZEOF
        + name_len
        + np.asarray(more_len, np.int64).reshape(-1)
        + np.where(np.asarray(has_pad, np.bool_).reshape(-1), Pad.SIZEOF, 0)
        + Zip64Local.SIZEOF
    )


def central_record_len(name_len, zip64, pad) -> np.ndarray:
    """Length of each central record: fixed part, name, zip64 extra (as
    :func:`central_zip64` decided), padding block copy (``pad`` -1: none)."""
    name_len = np.asarray(name_len, np.int64).reshape(-1)
    zip64 = np.asarray(zip64, np.int64).reshape(-1)
    return (
        Central.SIZEOF
        + name_len
        + _central_zip64_len(zip64)
        + _pad_len(np.asarray(pad, np.int64).reshape(-1))
    )


def needs_zip64_end(count: int, cd_offset: int, cd_size: int) -> bool:
    """Whether the zip64 end records are written (zipfile's rule)."""
    return count > ZIP_COUNT_LIMIT or cd_offset > ZIP64_LIMIT or cd_size > ZIP64_LIMIT


def end_records_len(zip64_end: bool) -> int:
    """Bytes after the central directory."""
    return (Zip64End.SIZEOF + Zip64Locator.SIZEOF if zip64_end else 0) + End.SIZEOF


# ---------------------------------------------------------------------------
# Packers
# ---------------------------------------------------------------------------
def dos_datetime(timestamp: float | None = None) -> tuple[int, int]:
    """DOS ``(time, date)`` of a local time, as zipfile stamps entries."""
    t = time.localtime(timestamp)
    year = max(t.tm_year, 1980)
    return (
        t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2,
        (year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday,
    )


def name_flags(name: str, method: int) -> tuple[bytes, int]:
    """Encoded name and general-purpose flags (UTF-8 bit only when needed)."""
    flags = _FLAG_LZMA_EOS if method == LZMA else 0
    try:
        return name.encode("ascii"), flags
    except UnicodeEncodeError:
        return name.encode("utf-8"), flags | FLAG_UTF8


def _versions(methods: np.ndarray) -> np.ndarray:
    """ "Version needed to extract": 45 (zip64), 46 for bzip2, 63 for lzma."""
    out = np.full(methods.shape, _ZIP64_VERSION, np.int64)
    out[methods == BZIP2] = 46
    out[methods == LZMA] = 63
    return out


def _pad_blocks(pads: np.ndarray) -> list[bytes]:
    """Padding extra blocks (``pad`` -1: no block)."""
    heads = np.zeros(pads.size, _PAD_DT)
    heads["id"] = PAD_EXTRA_ID
    heads["len"] = np.maximum(pads, 0)
    raw = heads.tobytes()
    k = Pad.SIZEOF
    return [b"" if p < 0 else raw[k * i : k * i + k] + bytes(p) for i, p in enumerate(pads.tolist())]


def _col(values, n: int) -> np.ndarray:
    return np.asarray(values, np.int64).reshape(n)


def local_headers(
    names: list[bytes],
    *,
    crc,
    size,
    csize,
    method,
    dos: tuple[int, int],
    pad,
    flags,
    more: list[bytes] | None = None,
) -> list[bytes]:
    """Local file headers (with name and extra field) of many entries at once.

    Array arguments are per entry; ``pad`` is the payload padding, -1 for
    entries without a padding block. Sizes go in the zip64 extra, the 32-bit
    fields hold ``0xFFFFFFFF``. ``more`` are extra blocks placed first (the
    segment tables of compressed entries).

    Examples
    --------
    >>> [len(h) for h in local_headers([b"a.memmap"], crc=[0], size=[4], csize=[4], method=[0],
    ...                                dos=(0, 33), pad=[6], flags=[0])]
    [68]
    """
    n = len(names)
    more = [b""] * n if more is None else more
    method = _col(method, n)
    pad = _col(pad, n)
    fixed = np.zeros(n, LOCAL_DT)
    fixed["sig"] = LOCAL_SIG
    fixed["version"] = _versions(method)
    fixed["flags"] = _col(flags, n)
    fixed["method"] = method
    fixed["time"], fixed["date"] = dos
    fixed["crc"] = _col(crc, n)
    fixed["csize"] = fixed["size"] = 0xFFFFFFFF
    fixed["name_len"] = [len(b) for b in names]
    fixed["extra_len"] = _pad_len(pad) + Zip64Local.SIZEOF + np.array([len(m) for m in more], np.int64)
    z64 = np.zeros(n, ZIP64_LOCAL_DT)
    z64["id"], z64["len"] = ZIP64_EXTRA_ID, Zip64Local.SIZEOF - Extra.SIZEOF
    z64["size"] = _col(size, n)
    z64["csize"] = _col(csize, n)
    fb, zb = fixed.tobytes(), z64.tobytes()
    pads = _pad_blocks(pad)
    a, b = Local.SIZEOF, Zip64Local.SIZEOF
    return [fb[a * i : a * i + a] + names[i] + more[i] + pads[i] + zb[b * i : b * i + b] for i in range(n)]


def central_directory(
    names: list[bytes], *, crc, size, csize, method, dos: tuple[int, int], pad, flags, header_offset, zip64
) -> bytes:
    """The central directory records of many entries, as one bytes object.

    ``zip64`` is the decision of :func:`central_zip64` (carried by the layout
    plan); the padding block of aligned entries is copied after the zip64 extra.

    Examples
    --------
    >>> cd = central_directory([b"a"], crc=[0], size=[3 << 30], csize=[1], method=[8], dos=(0, 33),
    ...                        pad=[-1], flags=[0], header_offset=[0], zip64=central_zip64([3 << 30], [1], [0]))
    >>> len(cd) == int(central_record_len([1], [ZIP64_SIZES], [-1])[0])
    True
    """
    n = len(names)
    method = _col(method, n)
    size = _col(size, n)
    csize = _col(csize, n)
    hoff = _col(header_offset, n)
    zip64 = _col(zip64, n)
    pad = _col(pad, n)
    big_size = (zip64 & ZIP64_SIZES) != 0
    big_off = (zip64 & ZIP64_OFFSET) != 0
    z64 = [b""] * n
    for i in np.nonzero(zip64)[0].tolist():
        values = ([int(size[i]), int(csize[i])] if big_size[i] else []) + (
            [int(hoff[i])] if big_off[i] else []
        )
        z64[i] = struct.pack(f"<HH{len(values)}Q", ZIP64_EXTRA_ID, 8 * len(values), *values)
    pads = _pad_blocks(pad)
    version = _versions(method)
    fixed = np.zeros(n, CENTRAL_DT)
    fixed["sig"] = CENTRAL_SIG
    fixed["made_by"] = version | (_CREATE_SYSTEM_UNIX << 8)
    fixed["version"] = version
    fixed["flags"] = _col(flags, n)
    fixed["method"] = method
    fixed["time"], fixed["date"] = dos
    fixed["crc"] = _col(crc, n)
    fixed["csize"] = np.where(big_size, 0xFFFFFFFF, csize)
    fixed["size"] = np.where(big_size, 0xFFFFFFFF, size)
    fixed["name_len"] = [len(b) for b in names]
    fixed["extra_len"] = [len(a) + len(b) for a, b in zip(z64, pads)]
    fixed["external"] = _EXTERNAL_ATTR
    fixed["header_offset"] = np.where(big_off, 0xFFFFFFFF, hoff)
    fb = fixed.tobytes()
    k = Central.SIZEOF
    return b"".join(fb[k * i : k * i + k] + names[i] + z64[i] + pads[i] for i in range(n))


def end_records(count: int, cd_offset: int, cd_size: int, zip64: bool) -> bytes:
    """The end-of-central-directory record, preceded by the zip64 end records
    when ``zip64`` (see :func:`needs_zip64_end`)."""
    out = b""
    if zip64:
        z = np.zeros(1, ZIP64_END_DT)
        z["sig"] = ZIP64_END_SIG
        z["record_size"] = Zip64End.SIZEOF - Zip64End.MADE_BY
        z["made_by"] = z["version"] = _ZIP64_VERSION
        z["disk_count"] = z["count"] = count
        z["cd_size"], z["cd_offset"] = cd_size, cd_offset
        loc = np.zeros(1, ZIP64_LOCATOR_DT)
        loc["sig"] = ZIP64_LOCATOR_SIG
        loc["end_offset"] = cd_offset + cd_size
        loc["disks"] = 1
        out = z.tobytes() + loc.tobytes()
        count = min(count, 0xFFFF)
        cd_size = min(cd_size, 0xFFFFFFFF)
        cd_offset = min(cd_offset, 0xFFFFFFFF)
    end = np.zeros(1, END_DT)
    end["sig"] = END_SIG
    end["disk_count"] = end["count"] = count
    end["cd_size"], end["cd_offset"] = cd_size, cd_offset
    return out + end.tobytes()


# ---------------------------------------------------------------------------
# Reading the end records
# ---------------------------------------------------------------------------
class EndRecord(NamedTuple):
    """Where the central directory is: from the (zip64) end records."""

    count: int  # type: ignore[assignment]  # (a field, not tuple.count)
    cd_offset: int
    cd_size: int
    end_offset: int  # offset of the (zip64) end-of-central-directory record
    zip64: bool


def read_record(buf, offset: int, dtype: np.dtype):
    """One record (a numpy structured scalar) at ``offset`` of ``buf``; None when
    it does not fit inside ``buf``."""
    if offset < 0 or offset > len(buf) - dtype.itemsize:
        return None
    return np.frombuffer(bytes(buf[offset : offset + dtype.itemsize]), dtype)[0]


def end_record_position(tail: bytes) -> int:
    """Position in ``tail`` (the last bytes of a file) of the end-of-central-directory
    record whose comment reaches exactly to the end; -1 if there is none."""
    pos = tail.rfind(END_SIG)
    while pos >= 0:
        if pos + End.SIZEOF <= len(tail):
            comment_len = int.from_bytes(tail[pos + End.COMMENT_LEN : pos + End.SIZEOF], "little")
            if pos + End.SIZEOF + comment_len == len(tail):
                return pos
        pos = tail.rfind(END_SIG, 0, pos)
    return -1


#: A local header's fixed 30 bytes as one ``struct`` layout (for the pure-Python readers).
LOCAL_STRUCT = struct.Struct("<IHHHHHIIIHH")
assert LOCAL_STRUCT.size == Local.SIZEOF
#: The end-of-central-directory record's 22 bytes as one ``struct`` layout.
END_STRUCT = struct.Struct("<4sHHHHIIH")
assert END_STRUCT.size == End.SIZEOF


def central_directory_fits(size: int, cd_offset: int, cd_size: int, count: int) -> bool:
    """Whether end-record values can describe a central directory inside a file of ``size``
    bytes: offset and size non-negative and within the file, and ``count`` records of at
    least 46 bytes fitting in ``cd_size`` (the kernels make the same test).

    >>> central_directory_fits(100, 50, 46, 1), central_directory_fits(100, 50, 46, 2)
    (True, False)
    """
    return not (
        cd_offset < 0
        or cd_size < 0
        or count < 0
        or cd_offset > size
        or cd_size > size - cd_offset
        or count > cd_size // Central.SIZEOF
    )


# the end records as struct layouts (one call each; the dtypes above describe the same bytes)
_CENTRAL_SIZE = int(Central.SIZEOF)
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")


def find_end_record(buf, name: str = "archive") -> EndRecord:
    """Finds and validates the end records in ``buf`` (bytes-like, the whole file).

    Every field is checked against the file size before use (values are
    unsigned and may be up to ``2**64 - 1``).

    Raises
    ------
    BadArchiveError
        No end record, a truncated file, counts or offsets that point outside
        the file (``offset``, ``expected`` and ``found`` attributes set).
    UnsupportedError
        A multi-disk (spanned) archive.

    Examples
    --------
    >>> import io, zipfile
    >>> b = io.BytesIO()
    >>> with zipfile.ZipFile(b, "w") as z:
    ...     z.writestr("a", "hi")
    >>> find_end_record(b.getvalue()).count
    1
    """
    size = len(buf)
    if size < END_STRUCT.size:  # (the struct sizes, not the IntEnum members: ~7 us of a cold open)
        raise BadArchiveError(
            f"{name}: not a zip archive: {size} bytes, shorter than the "
            f"{int(End.SIZEOF)}-byte end-of-central-directory record",
            path=name,
            expected=int(End.SIZEOF),
            found=size,
        )
    end_offset = size - END_STRUCT.size
    rec = END_STRUCT.unpack_from(buf, end_offset)
    if rec[0] != END_SIG or rec[7]:  # a comment, or no record at the very end: search for it
        lo = max(0, size - (End.SIZEOF + 0xFFFF))
        tail = bytes(buf[lo:size])
        pos = end_record_position(tail)
        if pos < 0:
            raise BadArchiveError(
                f"{name}: no end-of-central-directory record (signature PK\\5\\6) in "
                f"the last {len(tail)} bytes: not a zip archive, or truncated",
                path=name,
            )
        end_offset = lo + pos
        rec = END_STRUCT.unpack_from(tail, pos)
    _, disk, cd_disk, n_disk, count, cd_size, cd_offset, _ = rec
    zip64 = False
    loc = end_offset - _ZIP64_LOCATOR.size
    if loc >= 0 and bytes(buf[loc : loc + 4]) == ZIP64_LOCATOR_SIG:
        _, _, z_end, n_disks = _ZIP64_LOCATOR.unpack_from(buf, loc)
        if z_end > loc - Zip64End.SIZEOF:  # also: the locator left no room for the record
            raise BadArchiveError(
                f"{name}: the zip64 end locator at offset {loc} points to offset "
                f"{z_end}, outside the file (expected <= {loc - Zip64End.SIZEOF})",
                path=name,
                offset=loc,
                expected=loc - Zip64End.SIZEOF,
                found=z_end,
            )
        z = _ZIP64_END.unpack_from(buf, z_end)
        sig = z[0].rstrip(b"\0")  # as the "S4" field of ZIP64_END_DT reads it
        if sig != ZIP64_END_SIG:
            raise BadArchiveError(
                f"{name}: no zip64 end record at offset {z_end} (expected signature PK\\6\\6, found {sig!r})",
                path=name,
                offset=z_end,
                expected=ZIP64_END_SIG,
                found=sig,
            )
        record_size = z[1]
        least = Zip64End.SIZEOF - Zip64End.MADE_BY
        if record_size < least or record_size > loc - z_end - Zip64End.MADE_BY:
            raise BadArchiveError(
                f"{name}: the zip64 end record at offset {z_end} declares {record_size} bytes, "
                f"expected {least}..{loc - z_end - Zip64End.MADE_BY} (up to its locator)",
                path=name,
                offset=z_end,
                expected=least,
                found=record_size,
            )
        _, _, _, _, disk, cd_disk, n_disk, count, cd_size, cd_offset = z
        zip64 = True
        if n_disks > 1:
            disk = 1
        end_offset = z_end
    if disk != 0 or cd_disk != 0 or n_disk != count:
        raise UnsupportedError(
            f"{name}: multi-disk (spanned) zip archives are not supported "
            f"(disk {disk}, central directory disk {cd_disk}, {n_disk} of {count} records on this disk)",
            path=name,
            offset=end_offset,
        )
    if cd_offset > end_offset or cd_size > end_offset - cd_offset:
        raise BadArchiveError(
            f"{name}: the central directory at offset {cd_offset} with {cd_size} "
            f"bytes runs past its end record at offset {end_offset} (file truncated?)",
            path=name,
            offset=cd_offset,
            expected=end_offset,
            found=cd_offset + cd_size,
        )
    if count > cd_size // _CENTRAL_SIZE:
        raise BadArchiveError(
            f"{name}: the end record lists {count} entries but the central "
            f"directory has only {cd_size} bytes (expected >= {count * Central.SIZEOF})",
            path=name,
            offset=end_offset,
            expected=count * Central.SIZEOF,
            found=cd_size,
        )
    return EndRecord(count, cd_offset, cd_size, end_offset, zip64)
