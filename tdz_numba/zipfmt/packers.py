"""Writing zip records: where zip64 fields go, every record length, and the packers.

One function decides where zip64 fields go (:func:`central_zip64`) and one computes every record
length (:func:`local_header_len`, :func:`central_record_len`); the layout plan
(:mod:`tdz_numba.zipfmt.layout`) calls them and hands the decisions to the packers
(:func:`local_headers`, :func:`central_directory`), which never decide again. The records
themselves are described in :mod:`tdz_numba.zipfmt.records`.

Examples
--------
>>> from tdz_numba.zipfmt import packers
>>> packers.central_zip64([10, 3 << 30], [10, 1 << 20], [0, 5 << 30]).tolist()
[0, 3]
"""

from __future__ import annotations

import struct
import time

import numpy as np

from .records import (
    _CREATE_SYSTEM_UNIX,
    _EXTERNAL_ATTR,
    _FLAG_LZMA_EOS,
    _PAD_DT,
    _ZIP64_VERSION,
    BZIP2,
    CENTRAL_DT,
    CENTRAL_SIG,
    END_DT,
    END_SIG,
    FLAG_UTF8,
    LOCAL_DT,
    LOCAL_SIG,
    LZMA,
    PAD_EXTRA_ID,
    ZIP64_END_DT,
    ZIP64_END_SIG,
    ZIP64_EXTRA_ID,
    ZIP64_LIMIT,
    ZIP64_LOCAL_DT,
    ZIP64_LOCATOR_DT,
    ZIP64_LOCATOR_SIG,
    ZIP_COUNT_LIMIT,
    Central,
    End,
    Extra,
    Local,
    Pad,
    Zip64End,
    Zip64Local,
    Zip64Locator,
)

__all__ = [
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
]


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
    names: list[bytes],
    *,
    crc,
    size,
    csize,
    method,
    dos: tuple[int, int],
    pad,
    flags,
    header_offset,
    zip64,
    more: list[bytes] | None = None,
) -> bytes:
    """The central directory records of many entries, as one bytes object.

    ``zip64`` is the decision of :func:`central_zip64` (carried by the layout
    plan); the padding block of aligned entries is copied after the zip64 extra;
    ``more``: blocks placed last (digest blocks, :mod:`tdz_numba.zipfmt.digest`).

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
    if more is not None:
        pads = [a + b for a, b in zip(pads, more)]
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
