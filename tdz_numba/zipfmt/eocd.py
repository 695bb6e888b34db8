"""Reading a zip's end records: where the central directory is, every value checked against
the file size before use.

Examples
--------
>>> from tdz_numba.zipfmt.eocd import central_directory_fits
>>> central_directory_fits(100, 50, 46, 1)
True
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import BadArchiveError, UnsupportedError
from .records import (
    END_SIG,
    END_STRUCT,
    ZIP64_END_SIG,
    ZIP64_END_STRUCT,
    ZIP64_LOCATOR_SIG,
    ZIP64_LOCATOR_STRUCT,
    Central,
    End,
    Zip64End,
)

__all__ = [
    "EndRecord",
    "find_end_record",
    "central_directory_fits",
    "read_record",
    "end_record_position",
]


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


_CENTRAL_SIZE = int(Central.SIZEOF)
_ZIP64_END = ZIP64_END_STRUCT
_ZIP64_LOCATOR = ZIP64_LOCATOR_STRUCT


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
        _, z_disk, z_end, n_disks = _ZIP64_LOCATOR.unpack_from(buf, loc)
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
        if n_disks > 1 or z_disk != 0:  # as zipfile: the locator names another disk
            disk = max(disk, 1)
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
