"""The index of a small archive in plain Python: the central directory read with :mod:`struct`.

Opening a small archive is dominated by the number of distinct calls it makes,
not by the bytes it reads: with the CPU caches cold (a ``gc.collect()`` before
the open, as a benchmark does), each numpy or Numba call costs tens of
microseconds. For archives of up to :data:`SMALL_ENTRIES` entries, and of any
size when the Numba kernel would not run anyway (its pure-Python twin does the
same work with numpy on top), :class:`~tdz_numba.zipfmt.index.ArchiveIndex` therefore
reads the central directory here into lists (the rows of
:data:`tdz_numba.zipfmt.records.Col`, as Python ints) and builds its numpy columns only
when something asks for them.

This path only *accepts*: :func:`parse_small` and :func:`resolve_small` return
None for anything that is not a plain, well-formed archive (a bad signature,
bounds, overlapping records, zip64 values it cannot read, encrypted entries,
unknown methods, duplicate or non-UTF-8 names, ...), and the caller then takes
the general path (the :func:`~tdz_numba.zipfmt.kernels.crc.parse_central_directory`
kernel or its twin), which decides and names what is wrong. So a hostile file
gets the same :class:`~tdz_numba.TdzError` either way, and what this module
accepts gives the same rows the kernel gives (``tests/test_smallindex.py``
compares them on many archives, corrupted ones included).

Examples
--------
>>> import tempfile, pathlib, mmap, torch, tdz_numba
>>> from tdz_numba.zipfmt import records; from tdz_numba.zipfmt import smallindex
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz")
...     data = p.read_bytes()
>>> end = eocd.find_end_record(data)
>>> rows, names, by_name = smallindex.parse_small(data, end.cd_offset, end.cd_size, end.count)
>>> names, smallindex.resolve_small(data, rows[1], end.cd_offset)[0] % 64
(['meta.json', 'a.memmap'], 0)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any
from zlib import crc32

from ..errors import InternalError
from . import eocd, records
from .kernels import dispatch as kernel_dispatch

__all__ = [
    "SMALL_ENTRIES",
    "SmallRows",
    "parse_small",
    "parse_tail",
    "read_small_entry",
    "resolve_small",
    "tail_start",
]

#: Archives with at most this many entries are indexed here (above it the kernel is faster,
#: when it runs: see ``reader._small_enough``).
SMALL_ENTRIES = 256

_CD = records.CENTRAL_INDEX_STRUCT
_LH = records.LOCAL_STRUCT
_EXTRA = records.EXTRA_STRUCT
_U64 = records.U64_STRUCT
_END = records.END_STRUCT
_END_SIZEOF = int(records.End.SIZEOF)
_LOCATOR_SIZEOF = int(records.Zip64Locator.SIZEOF)
_U16_MAX = 0xFFFF
_CD_SIZEOF = int(records.Central.SIZEOF)
_LH_SIZEOF = int(records.Local.SIZEOF)
_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1
_CENTRAL_SIG = records.CENTRAL_SIG
_LOCAL_SIG = records.LOCAL_SIG
_KNOWN_METHODS = frozenset(records.METHOD_NAMES)
_ENCRYPTED = records.FLAG_ENCRYPTED
_BY_HEADER = itemgetter(records.Col.HEADER_OFFSET)
if records.Col.NEXT_OFFSET != len(records.Col) - 1:  # the rows below are built in column order
    raise InternalError("smallindex: records.Col.NEXT_OFFSET must be the last index column")


def _zip64(cd: bytes, q: int, qend: int, usize: int, csize: int, hoff: int) -> tuple[int, int, int] | None:
    """The zip64 extra values of one central record (None: missing, or too large for the index)."""
    need = (usize == _U32_MAX) + (csize == _U32_MAX) + (hoff == _U32_MAX)
    while q <= qend - 4:
        tag, size = _EXTRA.unpack_from(cd, q)
        if size > qend - q - 4:
            return None
        if tag == records.ZIP64_EXTRA_ID:
            if size < 8 * need:
                return None
            r = q + 4
            if usize == _U32_MAX:
                usize = _U64.unpack_from(cd, r)[0]
                r += 8
            if csize == _U32_MAX:
                csize = _U64.unpack_from(cd, r)[0]
                r += 8
            if hoff == _U32_MAX:
                hoff = _U64.unpack_from(cd, r)[0]
            if usize > _I64_MAX or csize > _I64_MAX or hoff > _I64_MAX:
                return None  # the general path says which value is out of range
            return usize, csize, hoff
        q += 4 + size
    return None


class SmallRows:
    """The rows :func:`parse_small` returns: a sequence of ``list[int]`` (one per entry, in
    :class:`~tdz_numba.zipfmt.records.Col` order), each built from its central record on first use.

    The open checks every record but keeps only where each one starts: a lazy open that
    reads a few entries (the root ``meta.json``) builds a few rows, not one list of 14
    ints per entry. Rows are built from the copy of the central directory that was
    checked (not from the mapping, which another process may change), and the same row
    list is returned on every access (callers fill in payload offsets in place).
    """

    __slots__ = ("_cd", "_starts", "_rows", "_cd_offset", "_zip64")

    def __init__(
        self,
        cd: bytes,
        starts: Sequence[int],
        cd_offset: int,
        zip64: dict[int, tuple[int, int, int]] | None,
        rows: list[list[int] | None] | None = None,
    ) -> None:
        self._cd = cd
        self._starts = starts
        self._cd_offset = cd_offset
        self._zip64 = zip64  # entry -> (size, compressed size, header offset) from zip64 extras
        self._rows: list[Any] = rows if rows is not None else [None] * len(starts)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> list[int]:
        row = self._rows[i]  # (IndexError as a list raises it)
        if row is None:
            if i < 0:
                i += len(self._rows)
            row = self._rows[i] = self._build(i)
        return row

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all())

    def all(self) -> list[list[int]]:
        """Every row (those not built yet are built now)."""
        rows = self._rows
        if None in rows:
            for i, row in enumerate(rows):
                if row is None:
                    rows[i] = self._build(i)
        return rows  # type: ignore[return-value]

    def _fields(self, i: int) -> tuple[int, ...]:
        """Record ``i``'s fixed fields, with its zip64 values."""
        f = _CD.unpack_from(self._cd, self._starts[i])
        z = self._zip64.get(i) if self._zip64 else None
        if z is not None:
            f = f[:6] + (z[1], z[0]) + f[8:11] + (z[2],)
        return f

    def _build(self, i: int) -> list[int]:
        _, flags, method, dtime, ddate, crc, csize, usize, nlen, _, _, hoff = self._fields(i)
        p = self._starts[i]
        cd_offset = self._cd_offset
        nxt = self._fields(i + 1)[11] if i + 1 < len(self._starts) else cd_offset  # (records in file order)
        noff, coff = cd_offset + p + _CD_SIZEOF, cd_offset + p
        # Col order: flags method crc csize size hoff noff nlen payload coff time date lextra next
        return [flags, method, crc, csize, usize, hoff, noff, nlen, -1, coff, dtime, ddate, -1, nxt]


def parse_small(
    data, cd_offset: int, cd_size: int, count: int
) -> tuple[SmallRows, list[str], dict[str, int]] | None:
    """The central directory of a plain, well-formed archive: ``(rows, names, by_name)``.

    Parameters
    ----------
    data : mmap.mmap or bytes
        The whole file (slicing it gives ``bytes``).
    cd_offset, cd_size, count : int
        From :func:`tdz_numba.zipfmt.eocd.find_end_record`.

    Returns
    -------
    tuple or None
        ``rows``: a :class:`SmallRows`, one list of ints per entry in
        :class:`~tdz_numba.zipfmt.records.Col` order (the kernel's columns with
        ``check_local=False``: payload offset and local extra length -1), built
        on first access; ``names``: the decoded entry names; ``by_name``:
        name -> row. None when anything is unusual or wrong: the general path
        then decides (and raises).
    """
    if not eocd.central_directory_fits(len(data), cd_offset, cd_size, count):
        return None
    return _parse_any(data[cd_offset : cd_offset + cd_size], cd_offset, count)


def _parse_any(cd: bytes, cd_offset: int, count: int) -> tuple[SmallRows, list[str], dict[str, int]] | None:
    """:func:`_parse_central`, by the :func:`~tdz_numba.zipfmt.kernels.names.walk_central` kernel when the
    dispatcher runs kernels and the kernel accepts the central directory (a plain one: no zip64
    values, records in file order, ASCII names without NUL); the same result either way."""
    walked = kernel_dispatch.walk_central(cd, cd_offset, count)
    if walked is None:
        return _parse_central(cd, cd_offset, count)
    starts, text = walked
    names = text.split("\x00") if count else []
    by_name = dict(zip(names, range(count)))
    if len(by_name) != count:  # a name twice (the general path names it)
        return None
    return SmallRows(cd, starts, cd_offset, None), names, by_name


def _parse_central(
    cd: bytes, cd_offset: int, count: int
) -> tuple[SmallRows, list[str], dict[str, int]] | None:
    """:func:`parse_small` on the central directory's bytes ``cd`` (at ``cd_offset``, inside the file)."""
    cd_size = len(cd)
    text = cd.decode("latin-1")  # one char per byte: offsets carry over
    unpack = _CD.unpack_from
    known = _KNOWN_METHODS
    header_limit = cd_offset - _LH_SIZEOF
    names: list[str] = []
    starts: list[int] = []
    add_name, add_start = names.append, starts.append
    zip64: dict[int, tuple[int, int, int]] | None = None
    last = cd_size - _CD_SIZEOF
    in_order = True
    prev_hoff = -1
    prev_csize = least = p = 0
    for i in range(count):
        if p > last:
            return None
        sig, flags, method, _, _, _, csize, usize, nlen, elen, clen, hoff = unpack(cd, p)
        q = p + _CD_SIZEOF
        rec_end = q + nlen + elen + clen
        if sig != _CENTRAL_SIG or rec_end > cd_size or flags & _ENCRYPTED or method not in known:
            return None
        if usize == _U32_MAX or csize == _U32_MAX or hoff == _U32_MAX:
            found = _zip64(cd, q + nlen, q + nlen + elen, usize, csize, hoff)
            if found is None:
                return None
            usize, csize, hoff = found
            if zip64 is None:
                zip64 = {}
            zip64[i] = found
        if hoff > header_limit or (usize != csize and not method):  # (method 0: STORED)
            return None
        # records in file order (as writers write them): checked on the way
        if hoff < prev_hoff:
            in_order = False
        elif least > hoff or prev_csize > hoff - least:
            return None
        least = hoff + _LH_SIZEOF + nlen  # the record's smallest extent: header, name
        prev_hoff, prev_csize = hoff, csize
        add_start(p)
        add_name(text[q : q + nlen])
        p = rec_end
    if p != cd_size:  # more records than the end record counts
        return None
    rows = SmallRows(cd, starts, cd_offset, zip64)
    if count:
        if in_order:  # the last record ends before the central directory
            if least > cd_offset or prev_csize > cd_offset - least:
                return None
        else:
            rows = SmallRows(cd, starts, cd_offset, zip64, [rows._build(i) for i in range(count)])
            if not _no_overlap(rows._rows, cd_offset):  # type: ignore[arg-type]
                return None
    if not "".join(names).isascii():  # bytes >= 0x80: UTF-8 names (anything else: the general path)
        try:
            names = [n if n.isascii() else n.encode("latin-1").decode("utf-8") for n in names]
        except UnicodeDecodeError:
            return None
    by_name = dict(zip(names, range(count)))
    if len(by_name) != count:
        return None
    return rows, names, by_name


def _no_overlap(rows: list[list[int]], cd_offset: int) -> bool:
    """Whether no record overlaps the next one in file order (the central directory lists
    them in another order); fills each row's ``NEXT_OFFSET``.

    The rows are sorted by header offset (stably, as the kernel sorts) and each record's
    smallest extent (header, name, stored bytes) must end before the next one starts.
    """
    ordered = sorted(rows, key=_BY_HEADER)
    ordered.append([0, 0, 0, 0, 0, cd_offset])  # the central directory bounds the last one
    row = ordered[0]
    for following in ordered[1:]:
        limit = following[5]
        least = row[5] + _LH_SIZEOF + row[7]
        if least > limit or row[3] > limit - least:
            return False
        row[13] = limit
        row = following
    return True


def resolve_small(
    data, row: list[int], cd_offset: int, base: int = 0, central: bytes | None = None
) -> tuple[int, int] | None:
    """``(payload offset, local extra length)`` of one entry from its local header
    (``row`` from :func:`parse_small`); None when the header is not as it must be
    (the general path then names the problem).

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
        name = central[noff - cd_offset : noff - cd_offset + nlen]
    if data[start - base : start - base + nlen] != name or len(name) != nlen:
        return None
    payload = start + lnlen + lelen
    csize = row[3]
    if payload > limit or csize > limit - payload:
        return None
    return payload, lelen


def parse_tail(
    tail: bytes, size: int, max_count: int = SMALL_ENTRIES
) -> tuple[eocd.EndRecord, SmallRows, list[str], dict[str, int]] | None:
    """The end record and the central directory of a plain archive of ``size`` bytes from
    its last bytes ``tail`` (read with ``pread``: nothing mapped): ``(end, rows, names,
    by_name)``, as :func:`~tdz_numba.zipfmt.eocd.find_end_record` and :func:`parse_small` give
    them. None unless the end record is the file's last bytes (no comment, no zip64
    records), the central directory lies inside ``tail`` and lists at most ``max_count``
    entries; also when :func:`parse_small` refuses it: the caller maps the file and takes
    the general path, which names what is wrong (:func:`tail_start`: where a longer tail
    would start).
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
    found = _parse_any(tail[cd_offset - base : cd_offset - base + cd_size], cd_offset, count)
    if found is None:
        return None
    return eocd.EndRecord(count, cd_offset, cd_size, end_offset, False), *found


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
    fd: int, rows: SmallRows, i: int, cd_offset: int, limit: int, head: bytes = b""
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
        found = resolve_small(chunk, row, cd_offset, hoff, rows._cd)
        if found is None or found[0] + csize > hoff + len(chunk):
            return None
        row[8], row[12] = found
        chunk = chunk[found[0] - hoff : found[0] - hoff + csize]
    if len(chunk) != csize or crc32(chunk) != row[2]:
        return None
    return chunk
