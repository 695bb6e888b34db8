"""The pure-Python twin of :mod:`tdz_numba.zipfmt.kernels.central`: the central-directory
parser and the local-header checks without Numba.

:func:`parse_central` makes the kernel's checks in the kernel's order and gives what
:func:`tdz_numba.zipfmt.kernels.dispatch.parse_central` gives from the kernel: a
:class:`Central` with the same status, the same columns (as :class:`CentralRows`), the
same names and the same first encrypted / unknown-method entries. It is what a small
archive's open runs when the kernels do not (a fresh process, see
:mod:`tdz_numba.jit.policy`), so it is lean: it reads each record with one ``struct``
call, slices the names from one decoded copy of the central directory, and keeps only
where each record starts; a row is built from that copy when first asked for.

No module here imports Numba.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.zipfmt import eocd
>>> from tdz_numba.zipfmt.kernels import central_twin
>>> with tempfile.TemporaryDirectory() as d:
...     data = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz").read_bytes()
>>> end = eocd.find_end_record(data)
>>> found = central_twin.parse_central(data[end.cd_offset : end.cd_offset + end.cd_size], end.cd_offset, 2)
>>> found.names, found.status, found.rows[1][records.Col.NEXT_OFFSET] == end.cd_offset
(['meta.json', 'a.memmap'], (0, 0, 0, 0), True)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from ...errors import InternalError
from .. import records

__all__ = ["Central", "CentralRows", "parse_central", "check_local_headers", "resolve_local"]

_CD = records.CENTRAL_INDEX_STRUCT
_LH = records.LOCAL_STRUCT
_EXTRA = records.EXTRA_STRUCT
_U64 = records.U64_STRUCT
_CD_SIZEOF = int(records.Central.SIZEOF)
_LH_SIZEOF = int(records.Local.SIZEOF)
_X_SIZEOF = int(records.Extra.SIZEOF)
_DIGEST_ID = records.DIGEST_EXTRA_ID
_DIGEST_LEN = int(records.DigestExtra.SIZEOF) - _X_SIZEOF
_DIGEST_ALGO = int(records.DigestExtra.ALGO)
_DIGEST_VALUE = int(records.DigestExtra.VALUE)
_DIGEST_SIZE = int(records.DigestExtra.SIZEOF) - _DIGEST_VALUE
_XXH3_128 = records.DIGEST_XXH3_128
_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1
_NCOLS = len(records.Col)
_KNOWN_METHODS = frozenset(records.METHOD_NAMES)
_ENCRYPTED = records.FLAG_ENCRYPTED
_C = records.Col
_S = records.Status
_HOFF, _NLEN, _CSIZE, _NEXT = int(_C.HEADER_OFFSET), int(_C.NAME_LEN), int(_C.CSIZE), int(_C.NEXT_OFFSET)
_NOFF = int(_C.NAME_OFFSET)
_U32 = struct.Struct("<I")
_CD_HOFF = int(records.Central.HEADER_OFFSET)  # where a central record holds its header offset
_OK = (0, 0, 0, 0)  # the status of a directory parsed without fault
if _NEXT != _NCOLS - 1:  # the rows below are built in column order
    raise InternalError("central_twin: records.Col.NEXT_OFFSET must be the last index column")


class CentralRows:
    """The rows of a parsed central directory: a sequence of ``list[int]`` (one per entry,
    in :class:`~tdz_numba.zipfmt.records.Col` order), each built on first use.

    Built from the kernel's columns (one row copied out when asked for) or, by the twin,
    from the copy of the central directory that was checked (not from the mapping, which
    another process may change). The same row list is returned on every access: callers
    fill in payload offsets in place, and :meth:`array` gives the columns with them.
    """

    __slots__ = ("cd", "cd_offset", "_n", "_rows", "_starts", "_zip64", "_cols", "digests")

    def __init__(
        self,
        cd: Any,
        cd_offset: int,
        n: int,
        starts: list[int] | None = None,
        zip64: dict[int, tuple[int, int, int]] | None = None,
        cols: np.ndarray | None = None,
        rows: list[Any] | None = None,
        digests: Any = None,
    ) -> None:
        self.cd = cd  # the central directory's bytes (bytes or a uint8 array)
        self.cd_offset = cd_offset
        self._n = n
        self._starts = starts  # where each record starts in cd (the twin's lazy rows)
        self._zip64 = zip64  # entry -> (size, compressed size, header offset) from zip64 extras
        self._cols = cols  # the kernel's columns
        self._rows: list[Any] | None = rows
        #: Where each entry's 16-byte digest lies in :attr:`cd` (-1: none); None: no entry has one.
        self.digests = digests

    def digest(self, i: int) -> bytes | None:
        """Entry ``i``'s digest (:class:`~tdz_numba.zipfmt.records.DigestExtra`), None when it has none."""
        digests = self.digests
        if digests is None:
            return None
        at = int(digests[i])
        return None if at < 0 else bytes(self.cd[at : at + _DIGEST_SIZE])

    def digest_offset(self, i: int) -> int:
        """Where entry ``i``'s digest lies in the file (-1: it has none)."""
        digests = self.digests
        at = -1 if digests is None else int(digests[i])
        return -1 if at < 0 else self.cd_offset + at

    def __len__(self) -> int:
        return self._n

    @property
    def kernel_columns(self) -> bool:
        """Whether the rows come from the kernel's columns (:meth:`array` is then free)."""
        return self._cols is not None

    def __getitem__(self, i: int) -> list[int]:
        rows = self._rows
        if rows is None:
            rows = self._rows = [None] * self._n
        row = rows[i]  # (IndexError as a list raises it)
        if row is None:
            if i < 0:
                i += self._n
            row = rows[i] = self._build(i)
        return row

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all())

    def all(self) -> list[list[int]]:
        """Every row (those not built yet are built now)."""
        rows = self._rows
        cols = self._cols
        if rows is None:
            rows = self._rows = cols.tolist() if cols is not None else [None] * self._n
        if None in rows:
            fresh = cols.tolist() if cols is not None else None
            for i, row in enumerate(rows):
                if row is None:
                    rows[i] = fresh[i] if fresh is not None else self._build(i)
        return rows

    def array(self) -> np.ndarray:
        """The rows as an int64 array ``(len, len(Col))`` (the kernel's columns themselves,
        with the values filled into built rows written back)."""
        cols = self._cols
        if cols is None:
            return np.array(self.all(), np.int64).reshape(-1, _NCOLS)
        if self._rows is not None:
            for i, row in enumerate(self._rows):
                if row is not None:
                    cols[i] = row
        return cols

    def name_bytes(self, i: int) -> bytes:
        """Entry ``i``'s name as stored."""
        row = self[i]
        start = row[_NOFF] - self.cd_offset
        return bytes(self.cd[start : start + row[_NLEN]])

    def _build(self, i: int) -> list[int]:
        cols = self._cols
        if cols is not None:
            return cols[i].tolist()
        starts: list[int] = self._starts  # type: ignore[assignment]
        cd, zip64 = self.cd, self._zip64
        f = _fields(cd, starts, zip64, i) if zip64 else _CD.unpack_from(cd, starts[i])
        row = _row(f, starts[i], self.cd_offset)
        # records in file order (a directory in another order is built at once): the next one's
        # header offset, its zip64 value if it has one
        j = i + 1
        if j >= self._n:
            row[_NEXT] = self.cd_offset
        elif zip64 and j in zip64:
            row[_NEXT] = zip64[j][2]
        else:
            row[_NEXT] = _U32.unpack_from(cd, starts[j] + _CD_HOFF)[0]
        return row


class Central(NamedTuple):
    """A parsed central directory: what the kernel and the twin both give."""

    #: One row per entry (``len(cd) // 46`` rows at most: none when the count is out of range).
    rows: CentralRows
    #: The names when every one is ASCII without NUL (None otherwise: decoded from ``rows``).
    names: list[str] | None
    #: ``(code, entry, expected, found)``, :class:`~tdz_numba.zipfmt.records.Status` codes.
    status: tuple[int, int, int, int]
    #: The first encrypted entry (-1: none; like ``unknown_method``, -1 unless the status is OK).
    encrypted: int
    #: The first entry of a compression method tdz_numba does not know (-1: none).
    unknown_method: int


def _row(f: tuple[int, ...], p: int, cd_offset: int) -> list[int]:
    """A row from a record's fields (``NEXT_OFFSET`` 0, as before the overlap pass)."""
    _, flags, method, dtime, ddate, crc, csize, usize, nlen, _, _, hoff = f
    q = cd_offset + p
    # Col order: flags method crc csize size hoff noff nlen payload coff time date lextra next
    return [flags, method, crc, csize, usize, hoff, q + _CD_SIZEOF, nlen, -1, q, dtime, ddate, -1, 0]


def _signed64(v: int) -> int:
    """A uint64 field as the kernel's int64: values >= 2**63 come out negative."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _sat_add(a: int, b: int) -> int:
    return a + b if b <= _I64_MAX - a else _I64_MAX


def _zip64(cd: bytes, q: int, qend: int, usize: int, csize: int, hoff: int) -> tuple[int, int, int] | None:
    """The zip64 extra values of one central record, or None when they are missing."""
    need = (usize == _U32_MAX) + (csize == _U32_MAX) + (hoff == _U32_MAX)
    while q <= qend - _X_SIZEOF:
        tag, size = _EXTRA.unpack_from(cd, q)
        if size > qend - q - _X_SIZEOF:
            return None
        if tag == records.ZIP64_EXTRA_ID:
            if size < 8 * need:
                return None
            r = q + _X_SIZEOF
            if usize == _U32_MAX:
                usize = _signed64(_U64.unpack_from(cd, r)[0])
                r += 8
            if csize == _U32_MAX:
                csize = _signed64(_U64.unpack_from(cd, r)[0])
                r += 8
            if hoff == _U32_MAX:
                hoff = _signed64(_U64.unpack_from(cd, r)[0])
            return usize, csize, hoff
        q += _X_SIZEOF + size
    return None


def _extra_blocks(cd: bytes, x: int, xend: int) -> int:
    """Walks the extra field ``cd[x:xend]`` as the kernel's ``_extra_blocks`` does: where its
    digest value lies (-1: none), or ``-2 - end`` for a block that runs to ``end`` past it."""
    found = -1
    while x <= xend - _X_SIZEOF:
        tag, size = _EXTRA.unpack_from(cd, x)
        if size > xend - x - _X_SIZEOF:
            return -2 - (x + _X_SIZEOF + size)
        if tag == _DIGEST_ID and size == _DIGEST_LEN and cd[x + _DIGEST_ALGO] == _XXH3_128:
            found = x + _DIGEST_VALUE
        x += _X_SIZEOF + size
    return found


def _failed(
    cd: bytes,
    cd_offset: int,
    n_rows: int,
    rows: list[list[int]],
    status: tuple[int, int, int, int],
) -> Central:
    """A failed walk: ``rows`` as the kernel left them (the rest zeros)."""
    rows = rows + [[0] * _NCOLS for _ in range(n_rows - len(rows))]
    return Central(CentralRows(cd, cd_offset, n_rows, rows=rows), None, status, -1, -1)


def _fields(cd: bytes, starts: list[int], zip64: dict | None, k: int) -> tuple[int, ...]:
    """Record ``k``'s fixed fields, with its zip64 values."""
    f = _CD.unpack_from(cd, starts[k])
    z = zip64.get(k) if zip64 else None
    return f if z is None else f[:6] + (z[1], z[0]) + f[8:11] + (z[2],)


def _named(flags: int, cd_offset: int, q: int, nlen: int, p: int) -> tuple[int, int, int, int]:
    """The name fields of a failing record (filled first: the error can name the entry)."""
    return flags, cd_offset + q, nlen, cd_offset + p


def _fail_walk(
    cd: bytes,
    cd_offset: int,
    n_rows: int,
    starts: list[int],
    zip64: dict | None,
    status: tuple[int, int, int, int],
    partial: tuple[int, int, int, int] | None,
) -> Central:
    """A walk that failed at record ``status[1]``: the rows before it built, its name fields
    (``partial``: flags, name offset, name length, central offset) when known."""
    done = [_row(_fields(cd, starts, zip64, k), starts[k], cd_offset) for k in range(len(starts))]
    if partial is not None:
        row = [0] * _NCOLS
        row[_C.FLAGS], row[_NOFF], row[_NLEN], row[_C.CENTRAL_OFFSET] = partial
        done.append(row)
    code, i, expected, found = status
    return _failed(cd, cd_offset, n_rows, done, (int(code), i, expected, found))


def parse_central(cd, cd_offset: int, count: int) -> Central:
    """The twin of :func:`tdz_numba.zipfmt.kernels.central.parse_central`: the same checks in the
    same order (see its notes), as :class:`Central`.

    Parameters
    ----------
    cd : bytes or uint8 array
        The central directory's bytes.
    cd_offset : int
        Where it starts in the file.
    count : int
        The records the end record lists.
    """
    if not isinstance(cd, bytes):
        cd = bytes(cd)
    n = len(cd)
    cd_offset, count = int(cd_offset), int(count)
    n_rows = count if 0 <= count <= n // _CD_SIZEOF else 0
    if cd_offset < 0 or count < 0 or count > n // _CD_SIZEOF:
        return _failed(cd, cd_offset, n_rows, [], (int(_S.CENTRAL_OVERRUN), -1, n, cd_offset))
    unpack = _CD.unpack_from
    unpack_extra = _EXTRA.unpack_from
    xsize, digest_id = _X_SIZEOF, _DIGEST_ID  # (locals: the loop below runs per record)
    digests: list[int] | None = None
    text = cd.decode("latin-1")  # one char per byte: offsets carry over
    known = _KNOWN_METHODS
    header_limit = cd_offset - _LH_SIZEOF
    names: list[str] = []
    starts: list[int] = []
    add_name, add_start = names.append, starts.append
    zip64: dict[int, tuple[int, int, int]] | None = None
    last = n - _CD_SIZEOF
    in_order = True
    overlap = False  # a record of a directory in file order runs into the next one
    prev_hoff = -1
    prev_csize = least = p = 0
    encrypted = unknown = -1

    for i in range(count):
        if p > last:
            return _fail_walk(cd, cd_offset, n_rows, starts, zip64, (_S.COUNT, i, count, i), None)
        sig, flags, method, _, _, _, csize, usize, nlen, elen, clen, hoff = unpack(cd, p)
        if sig != records.CENTRAL_SIG:
            return _fail_walk(
                cd,
                cd_offset,
                n_rows,
                starts,
                zip64,
                (_S.CENTRAL_SIGNATURE, i, records.CENTRAL_SIG, sig),
                None,
            )
        q = p + _CD_SIZEOF
        rec_end = q + nlen + elen + clen
        if rec_end > n:
            return _fail_walk(
                cd,
                cd_offset,
                n_rows,
                starts,
                zip64,
                (_S.CENTRAL_OVERRUN, i, cd_offset + n, cd_offset + rec_end),
                _named(flags, cd_offset, q, nlen, p),
            )
        if elen >= xsize:  # the extra blocks: each inside the field (zipfile's rule); the digest
            tag, size = unpack_extra(cd, q + nlen)
            if size != elen - xsize or tag == digest_id:  # (fast path: one block, not a digest)
                at = _extra_blocks(cd, q + nlen, q + nlen + elen)
                if at < -1:
                    end = -2 - at
                    return _fail_walk(
                        cd,
                        cd_offset,
                        n_rows,
                        starts,
                        zip64,
                        (_S.EXTRA_OVERRUN, i, cd_offset + q + nlen + elen, cd_offset + end),
                        _named(flags, cd_offset, q, nlen, p),
                    )
                if at >= 0:
                    if digests is None:
                        digests = [-1] * count
                    digests[i] = at
        if usize == _U32_MAX or csize == _U32_MAX or hoff == _U32_MAX:
            found = _zip64(cd, q + nlen, q + nlen + elen, usize, csize, hoff)
            if found is None:
                need = (usize == _U32_MAX) + (csize == _U32_MAX) + (hoff == _U32_MAX)
                return _fail_walk(
                    cd,
                    cd_offset,
                    n_rows,
                    starts,
                    zip64,
                    (_S.ZIP64_EXTRA, i, need, 0),
                    _named(flags, cd_offset, q, nlen, p),
                )
            usize, csize, hoff = found
            if zip64 is None:
                zip64 = {}
            zip64[i] = found
        if hoff < 0 or hoff > header_limit:
            return _fail_walk(
                cd,
                cd_offset,
                n_rows,
                starts,
                zip64,
                (_S.HEADER_PAST_END, i, cd_offset, hoff),
                _named(flags, cd_offset, q, nlen, p),
            )
        if csize < 0:
            return _fail_walk(
                cd,
                cd_offset,
                n_rows,
                starts,
                zip64,
                (_S.SIZE_RANGE, i, _I64_MAX, csize),
                _named(flags, cd_offset, q, nlen, p),
            )
        if usize < 0:
            return _fail_walk(
                cd,
                cd_offset,
                n_rows,
                starts,
                zip64,
                (_S.SIZE_RANGE, i, _I64_MAX, usize),
                _named(flags, cd_offset, q, nlen, p),
            )
        if usize != csize and method == records.STORED:
            return _fail_walk(
                cd,
                cd_offset,
                n_rows,
                starts,
                zip64,
                (_S.STORED_SIZE, i, csize, usize),
                _named(flags, cd_offset, q, nlen, p),
            )
        # records in file order (as writers write them): their overlap checked on the way
        if hoff < prev_hoff:
            in_order = False
        elif i and (least > hoff or prev_csize > hoff - least):
            overlap = True
        least = hoff + _LH_SIZEOF + nlen  # the record's smallest extent: header, name
        prev_hoff, prev_csize = hoff, csize
        if flags & _ENCRYPTED and encrypted < 0:
            encrypted = i
        if method not in known and unknown < 0:
            unknown = i
        add_start(p)
        add_name(text[q : q + nlen])
        p = rec_end
    if count and (least > cd_offset or prev_csize > cd_offset - least):
        overlap = True  # (the last record in file order, when in order)
    if in_order and not overlap:  # (positional: a call with keywords costs more with cold caches)
        rows = CentralRows(cd, cd_offset, count, starts, zip64, None, None, digests)
    else:  # the overlap pass over rows built now, in the kernel's order
        built = [_row(_fields(cd, starts, zip64, k), starts[k], cd_offset) for k in range(count)]
        order = list(range(count))
        if not in_order:
            order.sort(key=lambda k: built[k][_HOFF])  # (stable, as the kernel's sort)
        for j, a in enumerate(order):
            row = built[a]
            limit = built[order[j + 1]][_HOFF] if j + 1 < count else cd_offset
            row[_NEXT] = limit
            least = row[_HOFF] + _LH_SIZEOF + row[_NLEN]
            if least > limit or row[_CSIZE] > limit - least:
                stop = _sat_add(least, row[_CSIZE])
                if stop > cd_offset:
                    return _failed(
                        cd, cd_offset, n_rows, built, (int(_S.PAYLOAD_PAST_END), a, cd_offset, stop)
                    )
                return _failed(cd, cd_offset, n_rows, built, (int(_S.OVERLAP), a, stop, limit))
        rows = CentralRows(cd, cd_offset, count, rows=built, digests=digests)
    if p != n:  # more records than the end record counts
        return Central(rows, None, (int(_S.COUNT), count, count, -1), -1, -1)
    joined = "".join(names)
    plain = joined.isascii() and "\x00" not in joined
    # (tuple.__new__: not the NamedTuple's Python-level __new__, one call fewer per open)
    return tuple.__new__(Central, (rows, names if plain else None, _OK, encrypted, unknown))


# --------------------------------------------------------------------------
# Local headers (the same checks, in the same order, as the kernels)
# --------------------------------------------------------------------------
def _fail(status: np.ndarray, code: int, i: int, expected: int, found: int) -> bool:
    status[:] = (int(code), i, expected, found)
    return False


def _check_entry_header(
    hmv, h: int, buf, mv: memoryview, cols: np.ndarray, i: int, cd_offset: int, status
) -> bool:
    """The twin of :func:`tdz_numba.zipfmt.kernels.central.check_entry_header`: fills the payload
    offset and local extra length of row ``i``."""
    row = cols[i].tolist()
    hoff, limit, nlen = row[_HOFF], row[_NEXT], row[_NLEN]
    noff, csize = row[_NOFF], row[_CSIZE]
    if limit < 0 or limit > cd_offset or cd_offset > buf.size or hoff < 0 or hoff > limit - _LH_SIZEOF:
        return _fail(status, _S.HEADER_PAST_END, i, limit, hoff)
    if h < 0 or h > len(hmv) - _LH_SIZEOF:
        return _fail(status, _S.HEADER_PAST_END, i, limit, hoff)
    head = _LH.unpack_from(hmv, h)
    sig, lnlen, lelen = head[0], head[9], head[10]
    if sig != records.LOCAL_SIG:
        return _fail(status, _S.LOCAL_SIGNATURE, i, records.LOCAL_SIG, sig)
    if lnlen != nlen:
        return _fail(status, _S.NAME_MISMATCH, i, nlen, lnlen)
    start = hoff + _LH_SIZEOF
    if nlen > limit - start:
        return _fail(status, _S.OVERLAP, i, start + nlen, limit)
    if nlen > len(hmv) - (h + _LH_SIZEOF) or noff < 0 or nlen > len(mv) - noff:
        return _fail(status, _S.HEADER_PAST_END, i, limit, hoff)
    if hmv[h + _LH_SIZEOF : h + _LH_SIZEOF + nlen] != mv[noff : noff + nlen]:
        return _fail(status, _S.NAME_MISMATCH, i, nlen, nlen)
    payload = start + lnlen + lelen
    if payload > limit or csize < 0 or csize > limit - payload:
        stop = _sat_add(payload, max(csize, 0))
        if stop > cd_offset:
            return _fail(status, _S.PAYLOAD_PAST_END, i, cd_offset, stop)
        return _fail(status, _S.OVERLAP, i, stop, limit)
    cols[i, _C.PAYLOAD_OFFSET] = payload
    cols[i, _C.LOCAL_EXTRA_LEN] = lelen
    return True


def _bytes_view(buf) -> memoryview:
    return np.ascontiguousarray(buf).reshape(-1).data.cast("B")


def check_local_headers(
    buf, cols: np.ndarray, cd_offset: int, hdr: np.ndarray, hpos: np.ndarray
) -> np.ndarray:
    """The twin of :func:`tdz_numba.zipfmt.kernels.central.check_local_headers`."""
    status = np.zeros(4, np.int64)
    count = len(cols)
    if len(hpos) != count:
        _fail(status, _S.COUNT, -1, count, len(hpos))
        return status
    mv = _bytes_view(buf)
    hmv = mv if hdr is buf else _bytes_view(hdr)
    for i, h in enumerate(np.asarray(hpos).tolist()):
        if not _check_entry_header(hmv, h, buf, mv, cols, i, int(cd_offset), status):
            break
    return status


def resolve_local(buf, cols: np.ndarray, i: int, cd_offset: int) -> np.ndarray:
    """The twin of :func:`tdz_numba.zipfmt.kernels.central.resolve_local`."""
    status = np.zeros(4, np.int64)
    mv = _bytes_view(buf)
    i = int(i)
    _check_entry_header(mv, int(cols[i, _HOFF]), buf, mv, cols, i, int(cd_offset), status)
    return status
