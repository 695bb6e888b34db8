"""The central directory of an index: read, parsed by the one parser, turned into names or errors.

:class:`~tdz_numba.zipfmt.index.ArchiveIndex` reads the central directory either from
the file's last bytes (:func:`parse_tail`: one ``pread``, nothing mapped: a lazy open
of a plain archive) or from its mapping (:func:`read_central`); either way it is parsed
by :func:`tdz_numba.zipfmt.kernels.dispatch.parse_central` (the Numba kernel of
:mod:`tdz_numba.zipfmt.kernels.central` or its twin), and :func:`check_central` turns
the result into the entry names, or into the error that names what is wrong
(:func:`status_error`: the one place a status code becomes a message).

Opening a small archive is dominated by the number of distinct calls it makes, not by
the bytes it reads (with the CPU caches cold, each numpy or Numba call costs tens of
microseconds), so the rows stay lazy (:class:`~tdz_numba.zipfmt.kernels.central_twin.CentralRows`:
lists of Python ints built on first use), and a lazy open reads small STORED entries
(meta.json) with ``pread`` (:func:`read_small_entry`) before anything is mapped.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.zipfmt import central
>>> with tempfile.TemporaryDirectory() as d:
...     data = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz").read_bytes()
>>> end, found = central.parse_tail(data, len(data))
>>> names, by_name = central.check_central(found, "x.tdz", end, len(data))
>>> names, central.resolve_small(data, found.rows[1], end.cd_offset)[0] % 64
(['meta.json', 'a.memmap'], 0)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any
from zlib import crc32

import numpy as np

from ..errors import BadArchiveError, UnsupportedError
from ..files.pagecache import read_pieces
from . import eocd, records
from .kernels.central_twin import Central, CentralRows
from .kernels.dispatch import parse_central
from .records import Col, Status

__all__ = [
    "SMALL_ENTRIES",
    "Central",
    "CentralRows",
    "read_central",
    "parse_tail",
    "tail_start",
    "check_central",
    "status_error",
    "decode_name",
    "PREAD_SPACING",
    "check_local_headers",
    "check_local_by_pread",
    "resolve_small",
    "check_small",
    "read_small_entry",
]

#: A lazy open reads the central directory of archives of at most this many entries
#: from the file's tail with ``pread`` (larger ones are mapped first).
SMALL_ENTRIES = 256

_LH = records.LOCAL_STRUCT
_END = records.END_STRUCT
_END_SIZEOF = int(records.End.SIZEOF)
_LOCATOR_SIZEOF = int(records.Zip64Locator.SIZEOF)
_U16_MAX = 0xFFFF
_CD_SIZEOF = int(records.Central.SIZEOF)
_LH_SIZEOF = int(records.Local.SIZEOF)
_LOCAL_SIG = records.LOCAL_SIG
_U64 = (1 << 64) - 1
_STATUS_TEXT = {
    Status.CENTRAL_SIGNATURE: "central record signature: expected {expected:#x}, found {found:#x}",
    Status.CENTRAL_OVERRUN: "central record runs past the central directory end ({expected}) to {found}",
    Status.ZIP64_EXTRA: "a 0xFFFFFFFF field has no zip64 extra value ({expected} expected)",
    Status.HEADER_PAST_END: "local header offset {found} is outside the data area (< {expected})",
    Status.LOCAL_SIGNATURE: "local header signature: expected {expected:#x}, found {found:#x}",
    Status.NAME_MISMATCH: "local header name differs from the central directory name "
    "(central length {expected}, local {found})",
    Status.PAYLOAD_PAST_END: "payload runs to offset {found}, past the start of the central directory at {expected}",
    Status.OVERLAP: "payload runs to offset {expected}, overlapping the next record at {found}",
    Status.COUNT: "the end record lists {expected} entries, the central directory holds {found_text}",
    Status.SIZE_RANGE: "a size of {found} bytes is out of range (expected < 2**63)",
    Status.STORED_SIZE: "is stored with {expected} bytes but records an uncompressed size of {found}",
    Status.EXTRA_OVERRUN: "a central extra block runs to offset {found}, past the end of the record's "
    "extra field at {expected}",
}
#: Status codes raised before the entry's name is known.
_UNNAMED = (Status.CENTRAL_SIGNATURE, Status.CENTRAL_OVERRUN, Status.COUNT)


def read_central(data, end: eocd.EndRecord) -> Central:
    """The central directory that ``end`` names in ``data`` (the whole file: a mapping, bytes
    or a uint8 array), parsed from a copy (rows built later read what was checked, not the
    file as it is then); a central directory outside the file gives the status
    :data:`~tdz_numba.zipfmt.records.Status.CENTRAL_OVERRUN` for entry -1."""
    cd_offset, cd_size, count = end.cd_offset, end.cd_size, end.count
    if not eocd.central_directory_fits(len(data), cd_offset, cd_size, count):
        status = (int(Status.CENTRAL_OVERRUN), -1, len(data), cd_offset)
        return Central(CentralRows(b"", cd_offset, 0, rows=[]), None, status, -1, -1)
    cd = data[cd_offset : cd_offset + cd_size]
    return parse_central(cd if isinstance(cd, bytes) else bytes(cd), cd_offset, count)


def decode_name(raw: bytes, flags: int, i: int, label: str, offset: int) -> str:
    """An entry name from its stored bytes: UTF-8, else (without the UTF-8 flag) cp437.

    zip's legacy encoding is cp437; but Info-ZIP stores UTF-8 names without the flag, and
    meta.json keys are UTF-8, so UTF-8 is tried first.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        if flags & records.FLAG_UTF8:
            raise BadArchiveError(
                f"{label}: entry #{i} has the UTF-8 flag but its name is not UTF-8: {raw[:80]!r}",
                path=label,
                offset=offset,
                found=raw,
            ) from None
    return raw.decode("cp437")


def status_error(
    status: Sequence[int],
    label: str,
    end: eocd.EndRecord,
    size: int,
    rows: Any,  # lists, the lazy CentralRows or a columns array: rows[i][col]
    name_at: Callable[[int], str],
) -> BadArchiveError | None:
    """The error a status ``[code, entry, expected, found]`` of the index kernels (or their
    twins) stands for; None for OK.

    ``rows``: the index rows (lists, or a columns array) the status refers to;
    ``name_at(i)``: entry ``i``'s name (which may raise, for a name that cannot be decoded).
    """
    code = int(status[0])
    if code == Status.OK:
        return None
    code = Status(code)
    i = int(status[1])
    expected, found = int(status[2]), int(status[3])
    if i < 0:
        return BadArchiveError(
            f"{label}: the central directory (offset {end.cd_offset}, {end.cd_size} bytes, "
            f"{end.count} records) does not fit the file of {size} bytes",
            path=label,
            offset=end.cd_offset,
            expected=expected,
            found=found,
        )
    name = None if code in _UNNAMED or i >= len(rows) else name_at(i)
    who = f"entry #{i}" if name is None else f"entry {name!r}"
    if code == Status.SIZE_RANGE:
        found &= _U64
    text = _STATUS_TEXT[code].format(
        expected=expected, found=found, found_text="more" if found < 0 else found
    )
    offset = None
    if i < len(rows):
        column = (
            Col.HEADER_OFFSET
            if code in (Status.LOCAL_SIGNATURE, Status.NAME_MISMATCH)
            else Col.CENTRAL_OFFSET
        )
        offset = int(rows[i][column])
    return BadArchiveError(
        f"{label}: {who}: {text}", path=label, entry=name, offset=offset, expected=expected, found=found
    )


def _names(found: Central, label: str) -> list[str]:
    """Every entry's name (sliced from the central directory when some is not plain ASCII)."""
    if found.names is not None:
        return found.names
    rows = found.rows
    names = []
    for i in range(len(rows)):
        raw = rows.name_bytes(i)
        names.append(
            raw.decode("ascii")
            if raw.isascii()
            else decode_name(raw, rows[i][Col.FLAGS], i, label, rows[i][Col.NAME_OFFSET])
        )
    return names


def check_central(
    found: Central, label: str, end: eocd.EndRecord, size: int, status: Sequence[int] | None = None
) -> tuple[list[str], dict[str, int]]:
    """The names and ``name -> row`` of a parsed central directory, or the error for what is
    wrong, in this order: the parse's status (or ``status``, which replaces it: a check of
    the local headers), a name that cannot be decoded, the first encrypted entry, the first
    entry of an unknown compression method, a name that appears twice."""
    rows = found.rows
    status = found.status if status is None else status
    if status[0]:  # (not OK)
        error = status_error(status, label, end, size, rows, lambda i: _names_at(found, i, label))
        if error is not None:
            raise error
    names = found.names
    if names is None:  # (not every name plain ASCII: decoded one by one)
        names = _names(found, label)
    if found.encrypted >= 0:
        name = names[found.encrypted]
        raise UnsupportedError(f"{label}: entry {name!r} is encrypted", path=label, entry=name)
    i = found.unknown_method
    if i >= 0:
        method = rows[i][Col.METHOD]
        raise UnsupportedError(
            f"{label}: entry {names[i]!r} uses compression method {method}, "
            f"expected one of {sorted(records.METHOD_NAMES)} (stored, deflate, bzip2, lzma)",
            path=label,
            entry=names[i],
            expected=sorted(records.METHOD_NAMES),
            found=method,
        )
    by_name = dict(zip(names, range(len(names))))
    if len(by_name) != len(names):
        seen: set[str] = set()
        dup = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise BadArchiveError(f"{label}: entry {dup!r} appears twice", path=label, entry=dup)
    return names, by_name


def _names_at(found: Central, i: int, label: str) -> str:
    rows = found.rows
    return decode_name(rows.name_bytes(i), rows[i][Col.FLAGS], i, label, rows[i][Col.NAME_OFFSET])


#: Bytes of file per entry from which a whole-archive header check reads the local headers
#: with ``pread`` rather than through the mapping. A page fault maps the 64 KiB around it
#: (~2.3 us, fault-around), a ``pread`` of one header costs ~0.45 us: CPU time of the check
#: of 2,100 headers 32 KiB apart, 4.0 ms mapped against 2.55 ms read (1.1 against 3.4 ms
#: 128 KiB apart); below ~13 KiB apart the headers share the pages a fault maps.
PREAD_SPACING = 16 * 1024


def check_local_headers(
    buf, cols, cd_offset: int, path, ident: tuple[int, int, int] | None, spacing: int
) -> np.ndarray:
    """Checks every local header of an archive into ``cols`` (payload offsets filled), in entry
    order, by :func:`tdz_numba.zipfmt.kernels.dispatch.check_local_headers`; the status.

    ``buf``: the whole archive; ``spacing``: its bytes per entry. From :data:`PREAD_SPACING`
    on, the headers are read with ``pread`` (:func:`check_local_by_pread`) from ``path``
    while it names the file ``ident`` (``(st_dev, st_ino, st_size)``; None: never), else
    through ``buf``.
    """
    from .kernels.dispatch import check_local_headers as check  # the kernel or its twin

    if ident is not None and spacing >= PREAD_SPACING:
        local = check_local_by_pread(buf, cols, cd_offset, path, ident)
        if local is not None:  # (None: the file was replaced: the mapping is what counts)
            return local
    return check(buf, cols, cd_offset, buf, np.ascontiguousarray(cols[:, Col.HEADER_OFFSET]))


def check_local_by_pread(buf, cols, cd_offset: int, path, ident: tuple[int, int, int]) -> np.ndarray | None:
    """Checks every local header from copies read with ``pread``: one system call per
    entry instead of a page fault per entry when the headers are far apart, leaving the page
    cache as it was (:func:`tdz_numba.files.pagecache.read_pieces`). None when
    ``path`` no longer names the file ``ident`` that ``buf`` maps."""
    from .kernels.dispatch import check_local_headers as check  # the kernel or its twin

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != ident:
            return None
        # entry i's fixed header and name at hdr[hpos[i]:]; the names are in the central
        # directory, so the copies total at most its size plus 30 bytes per entry
        lengths = cols[:, Col.NAME_LEN] + _LH_SIZEOF
        hpos = np.zeros(len(cols), np.int64)
        np.cumsum(lengths[:-1], out=hpos[1:])
        # pages not cached before are dropped again (files.pagecache: the mapping's faults then
        # read them back in large folios); a short read (past the end) leaves zeros
        data = read_pieces(fd, cols[:, Col.HEADER_OFFSET].tolist(), lengths.tolist())
        hdr = np.frombuffer(data, np.uint8)
    finally:
        os.close(fd)
    return check(buf, cols, cd_offset, hdr, hpos)


def check_small(data, rows: list[list[int]], cd_offset: int) -> bool:
    """Whether every row's local header in ``data`` (the whole file) is as it must be, each
    checked by :func:`resolve_small` (an archive of up to :data:`SMALL_ENTRIES` entries whose
    headers lie close together: no columns built, no kernel called; a one-tensor ``.pt`` has 7);
    then the payload offsets and local extra lengths are filled into the rows. False, the rows
    untouched, when one is not (the kernel or its twin names it).

    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     data = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz").read_bytes()
    >>> end, found = parse_tail(data, len(data))
    >>> rows = found.rows.all()
    >>> check_small(data, rows, end.cd_offset), rows[1][Col.PAYLOAD_OFFSET] % 64
    (True, 0)
    """
    found = list(map(resolve_small, repeat(data, len(rows)), rows, repeat(cd_offset, len(rows))))
    if None in found:
        return False
    for row, (payload, extra) in zip(rows, found):  # type: ignore[misc]
        row[Col.PAYLOAD_OFFSET], row[Col.LOCAL_EXTRA_LEN] = payload, extra
    return True


def resolve_small(
    data, row: list[int], cd_offset: int, base: int = 0, central=None
) -> tuple[int, int] | None:
    """``(payload offset, local extra length)`` of one entry from its local header
    (``row`` from :class:`CentralRows`); None when the header is not as it must be
    (the kernel's check, :func:`tdz_numba.zipfmt.kernels.dispatch.resolve_local`, then
    names the problem).

    ``data`` holds the file's bytes from offset ``base`` on (the whole file, or a chunk
    read at the header: :func:`read_small_entry`); ``central``: the central directory's
    bytes (the central name is compared from there; default: from ``data``).
    """
    hoff, limit, nlen = row[5], row[13], row[7]
    if limit > cd_offset or hoff < base or hoff > limit - _LH_SIZEOF or hoff - base > len(data) - _LH_SIZEOF:
        return None
    head = _LH.unpack_from(data, hoff - base)
    lnlen, lelen = head[9], head[10]
    start = hoff + _LH_SIZEOF
    if head[0] != _LOCAL_SIG or lnlen != nlen or nlen > limit - start:
        return None
    noff = row[6]
    if central is None:
        name = data[noff - base : noff - base + nlen]
    else:
        name = bytes(central[noff - cd_offset : noff - cd_offset + nlen])
    if data[start - base : start - base + nlen] != name or len(name) != nlen:
        return None
    payload = start + lnlen + lelen
    csize = row[3]
    if payload > limit or csize > limit - payload:
        return None
    return payload, lelen


def parse_tail(
    tail: bytes, size: int, max_count: int = SMALL_ENTRIES
) -> tuple[eocd.EndRecord, Central] | None:
    """The end record and the parsed central directory of a plain archive of ``size`` bytes
    from its last bytes ``tail`` (read with ``pread``: nothing mapped), as
    :func:`~tdz_numba.zipfmt.eocd.find_end_record` and :func:`read_central` give them.

    None unless the end record is the file's last bytes (no comment, no zip64 records),
    the central directory lies inside ``tail`` and lists at most ``max_count`` entries;
    the caller then maps the file and reads the end records there (:func:`tail_start`:
    where a longer tail would start). A central directory that is wrong is parsed all
    the same: :func:`check_central` names the problem.
    """
    n = len(tail)
    base = size - n
    if n < _END_SIZEOF or n > size:
        return None
    sig, disk, cd_disk, n_disk, count, cd_size, cd_offset, comment = _END.unpack_from(tail, n - _END_SIZEOF)
    end_offset = size - _END_SIZEOF
    if sig != records.END_SIG or comment or disk or cd_disk or n_disk != count:
        return None
    loc = n - _END_SIZEOF - _LOCATOR_SIZEOF  # a zip64 locator there: the general path reads it
    if (loc < 0 and base) or (loc >= 0 and tail[loc : loc + 4] == records.ZIP64_LOCATOR_SIG):
        return None
    if cd_offset < base or cd_offset > end_offset or cd_size > end_offset - cd_offset:
        return None
    if count > cd_size // _CD_SIZEOF or count > max_count:
        return None
    found = parse_central(tail[cd_offset - base : cd_offset - base + cd_size], cd_offset, count)
    return tuple.__new__(eocd.EndRecord, (count, cd_offset, cd_size, end_offset, False)), found


def tail_start(tail: bytes, size: int, max_count: int = SMALL_ENTRIES) -> int | None:
    """Where the central directory named by the end record at the end of ``tail`` starts,
    when it starts before ``tail`` and lists at most ``max_count`` entries (a longer tail
    read from there may then be parsed by :func:`parse_tail`, which checks everything);
    None otherwise."""
    n = len(tail)
    if n < _END_SIZEOF or n >= size:
        return None
    sig, _, _, _, count, _, cd_offset, _ = _END.unpack_from(tail, n - _END_SIZEOF)
    if sig != records.END_SIG or count > max_count or not 0 <= cd_offset < size - n:
        return None
    return cd_offset


def read_small_entry(
    fd: int, rows: CentralRows, i: int, cd_offset: int, limit: int, head: bytes = b""
) -> bytes | None:
    """The bytes of STORED entry ``i`` of at most ``limit`` bytes read with ``pread`` (no
    mapping), its local header checked as :func:`resolve_small` checks it (the payload
    offset is filled into the row) and its CRC-32; None for anything else (the caller
    reads it through the mapping, where errors are named). ``head``: the file's first
    bytes, read already (an entry inside them is not read again)."""
    row = rows[i]
    csize = row[3]
    if row[1] or csize > limit:
        return None
    hoff = row[5]
    if row[8] >= 0:  # the header was read already
        start, stop = row[8], row[8] + csize
    else:
        start, stop = hoff, min(row[13], hoff + _LH_SIZEOF + row[7] + _U16_MAX + csize)
    if stop <= start or start < 0:
        return None
    chunk = head[start:stop] if stop <= len(head) else os.pread(fd, stop - start, start)
    if row[8] < 0:
        found = resolve_small(chunk, row, cd_offset, hoff, rows.cd)
        if found is None or found[0] + csize > hoff + len(chunk):
            return None
        row[8], row[12] = found
        chunk = chunk[found[0] - hoff : found[0] - hoff + csize]
    if len(chunk) != csize or crc32(chunk) != row[2]:
        return None
    return chunk
