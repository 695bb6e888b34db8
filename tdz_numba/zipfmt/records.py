"""The zip format, described once: every record's layout (a dtype, an IntEnum of field offsets,
a ``struct`` layout), the reader's index columns and the kernels' status codes.

Each record has one structured numpy dtype (``LOCAL_DT``, ``CENTRAL_DT``, ...),
its signature, and an :class:`~enum.IntEnum` of named field offsets with its
size as ``SIZEOF`` (:class:`Local`, :class:`Central`, ...): Python code packs
and unpacks through the dtypes, Numba kernels read fields at the offsets
(plain ``int`` constants). No other module spells an offset or a record size.

The zip64 rules and the packers that write these records are :mod:`tdz_numba.zipfmt.packers`;
reading the end records is :mod:`tdz_numba.zipfmt.eocd`.

The records match what Python's :mod:`zipfile` writes for tensordict 0.15.3
with ``force_zip64=True`` (version 45, a zip64 extra on every local header, a
``0x6474`` padding block before it on aligned entries), so our archives
differ from tensordict's only in their timestamps.

Examples
--------
>>> from tdz_numba.zipfmt import records
>>> int(records.Central.HEADER_OFFSET), records.LOCAL_DT.itemsize
(42, 30)
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from ..errors import InternalError

__all__ = [
    "ALIGNMENT",
    "PAD_EXTRA_ID",
    "ZIP64_EXTRA_ID",
    "SEGMENT_EXTRA_ID",
    "DIGEST_EXTRA_ID",
    "DIGEST_XXH3_128",
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
    "DigestExtra",
    "LOCAL_DT",
    "CENTRAL_DT",
    "EXTRA_DT",
    "ZIP64_LOCAL_DT",
    "END_DT",
    "ZIP64_END_DT",
    "ZIP64_LOCATOR_DT",
    "DESCRIPTOR_DT",
    "SEGMENT_TABLE_DT",
    "DIGEST_DT",
    "Col",
    "INDEX_DTYPE",
    "IndexRow",
    "Status",
    "LOCAL_STRUCT",
    "END_STRUCT",
    "CENTRAL_STRUCT",
    "CENTRAL_INDEX_STRUCT",
    "ZIP64_END_STRUCT",
    "ZIP64_LOCATOR_STRUCT",
    "EXTRA_STRUCT",
    "U64_STRUCT",
    "SEGMENT_TABLE_STRUCT",
    "DIGEST_STRUCT",
    "SEGMENT_VERSION",
]

#: Payload alignment of ``*.memmap`` entries (tensordict's ``_ALIGNMENT``).
ALIGNMENT = 64
#: Id of the padding extra block (``b"td"`` little-endian).
PAD_EXTRA_ID = 0x6474
ZIP64_EXTRA_ID = 0x0001
#: Id of our segment-table extra block of deflated entries (``b"tz"``).
SEGMENT_EXTRA_ID = 0x7A74
#: Version of our segment table layout.
SEGMENT_VERSION = 1
#: Id of our digest extra block of the central record (``b"th"``): :class:`DigestExtra`.
DIGEST_EXTRA_ID = 0x6874
#: :class:`DigestExtra` algorithm byte: XXH3-128 (the 16-byte canonical, big-endian digest).
DIGEST_XXH3_128 = 1

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


class DigestExtra(IntEnum):
    """Our ``0x6874`` digest block, in the *central* record only (never in the local header,
    written before the payload's digest is known), after the zip64 extra and the padding
    copy: id, length (17), the algorithm (:data:`DIGEST_XXH3_128`), then the 16-byte digest
    of the entry's uncompressed bytes (``xxhash.xxh3_128(payload).digest()``, big-endian: its
    hex is ``hexdigest()``). Zip readers skip extra blocks of ids they do not know (zipfile,
    Info-ZIP, tensordict's ``load_memmap``); a block of another length or algorithm is
    ignored as unknown."""

    ID = 0
    LEN = 2
    ALGO = 4
    VALUE = 5
    SIZEOF = 21


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
DIGEST_DT = np.dtype([("id", "<u2"), ("len", "<u2"), ("algo", "u1"), ("value", "S16")])
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
    (DigestExtra, DIGEST_DT),
):
    _check_described(_f, _d)


# ---------------------------------------------------------------------------
# The reader's index of the central directory
# ---------------------------------------------------------------------------
class Col(IntEnum):
    """Columns of the index built by :func:`tdz_numba.zipfmt.kernels.central.parse_central`
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
    EXTRA_OVERRUN = 12  # a central extra block runs past the record's extra field (zipfile refuses it)


# ---------------------------------------------------------------------------
# The records as struct layouts (the pure-Python readers; the dtypes above describe the same bytes)
# ---------------------------------------------------------------------------
#: A local header's fixed 30 bytes as one ``struct`` layout (for the pure-Python readers).
LOCAL_STRUCT = struct.Struct("<IHHHHHIIIHH")
#: A central record's fixed 46 bytes as one ``struct`` layout.
CENTRAL_STRUCT = struct.Struct("<IHHHHHHIIIHHHHHII")
#: The central record fields the index keeps, skipping the versions and the disk/attribute
#: fields: signature, flags, method, time, date, CRC, compressed size, size, name/extra/comment
#: lengths, header offset.
CENTRAL_INDEX_STRUCT = struct.Struct("<I4xHHHHIIIHHH8xI")
#: The end-of-central-directory record's 22 bytes as one ``struct`` layout.
END_STRUCT = struct.Struct("<4sHHHHIIH")
#: The zip64 end record's fixed 56 bytes and the zip64 locator's 20 as ``struct`` layouts.
ZIP64_END_STRUCT = struct.Struct("<4sQHHIIQQQQ")
ZIP64_LOCATOR_STRUCT = struct.Struct("<4sIQI")
#: Our segment table's fixed 20 bytes (:class:`SegmentTable`); the uint32 lengths follow.
SEGMENT_TABLE_STRUCT = struct.Struct("<HHIQI")
#: Our digest block (:class:`DigestExtra`): id, length, algorithm, the 16-byte digest.
DIGEST_STRUCT = struct.Struct("<HHB16s")
#: An extra block's header (id, length) and a zip64 extra's 8-byte value.
EXTRA_STRUCT = struct.Struct("<HH")
U64_STRUCT = struct.Struct("<Q")
for _st, _rec in (
    (LOCAL_STRUCT, Local),
    (CENTRAL_STRUCT, Central),
    (CENTRAL_INDEX_STRUCT, Central),
    (END_STRUCT, End),
    (ZIP64_END_STRUCT, Zip64End),
    (ZIP64_LOCATOR_STRUCT, Zip64Locator),
    (EXTRA_STRUCT, Extra),
    (SEGMENT_TABLE_STRUCT, SegmentTable),
    (DIGEST_STRUCT, DigestExtra),
):
    if _st.size != _rec.SIZEOF:
        raise InternalError(
            f"records: the struct layout of {_rec.__name__} is {_st.size} bytes, not {int(_rec.SIZEOF)}"
        )
if tuple(Col) != tuple(range(len(Col))):
    raise InternalError("records.Col: the index columns must be numbered 0, 1, ...")
