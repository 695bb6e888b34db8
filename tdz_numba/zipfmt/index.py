"""The reader's index: one mapping of the file, one pass over the central directory.

:class:`ArchiveIndex` reads the end records and the central directory (from the file's
tail with one ``pread`` for a plain archive of up to ``SMALL_ENTRIES`` entries, the file
mapped on first use; else from its mapping, private for ``mode="r"``, shared for
``mode="r+"``), parses it with the one parser
(:func:`~tdz_numba.zipfmt.kernels.central.parse_central` or its twin, through
:mod:`tdz_numba.zipfmt.central`) and reads each local header when first needed. It
knows, for every entry, where its payload is, how it is compressed and its
CRC; and for every directory, which files and sub-directories it holds. It
reads no payload.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.zipfmt.index import ArchiveIndex
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.zeros(4)}, pathlib.Path(d) / "x.tdz")
...     idx = ArchiveIndex(p)
...     print(idx.names, idx.entry("a.memmap").payload_offset % 64)
['meta.json', 'a.memmap'] 0
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from zlib import crc32

import numpy as np

from ..errors import BadArchiveError, ChecksumError
from ..files.loadadvice import map_cached_ahead
from ..files.scanadvice import SPARSE_SPACING, pages_only
from . import compression as codecs
from . import eocd, members, records
from .central import (
    PREAD_SPACING,
    SMALL_ENTRIES,
    Central,
    CentralRows,
    check_central,
    check_local_headers,
    check_small,
    decode_name,
    parse_tail,
    read_central,
    read_small_entry,
    resolve_small,
    status_error,
    tail_start,
)
from .lazymap import MAP_LOCK, LazyMapping, hold_descriptor, release_descriptor
from .listing import build_listing
from .records import Col, IndexRow, Status

__all__ = ["ArchiveIndex", "EntryInfo"]


@dataclass(frozen=True)
class EntryInfo:
    """Where an entry is and how it is stored."""

    name: str
    index: int
    header_offset: int
    payload_offset: int
    compressed_size: int
    size: int
    method: int
    crc: int
    flags: int
    central_offset: int


#: Entries up to this size are read by :meth:`ArchiveIndex.read_bytes` as a slice of the
#: mapping with the stdlib CRC-32 (meta.json files); larger ones through zlib-ng.
_SMALL_READ = 1 << 20
#: Bytes at the end of the file an open reads with ``pread`` (end record and central directory
#: of a small archive: the file is mapped when a payload is first read); a central directory
#: that starts before them is read with a second ``pread`` when it is within ``_TAIL_MAX``.
#: (A cold ``pread`` of 16 KiB: ~33 us, of 64 KiB: ~45 us.)
_TAIL_BYTES = 32 * 1024
_TAIL_MAX = 256 * 1024


class ArchiveIndex(LazyMapping):
    """Index over an archive and the single memory map of its bytes.

    :attr:`table` holds one row per entry (a structured array with the fields
    of :data:`tdz_numba.zipfmt.records.INDEX_DTYPE`: ``method``, ``csize``, ``size``,
    ``payload_offset``, ...); :attr:`rows` the same as :class:`~tdz_numba.zipfmt.records.IndexRow` tuples.
    """

    _buffer: np.ndarray | None
    names: list[str]
    _by_name: dict[str, int]
    _files: dict[str, set[str]] | None
    _dirs: dict[str, set[str]] | None
    _cols_np: np.ndarray | None  # the index as numpy columns (None: still only in _small)
    _table: np.ndarray | None
    _small: CentralRows | None  # the rows as lists, built on first use (None: in _cols_np)
    _central: CentralRows | None = None  # the parsed central directory (names are decoded from it)
    _head: bytes = b""  # the file's first bytes, read by the caller (format detection) with that descriptor

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        writable: bool = False,
        check_local: bool = False,
        fd: int | None = None,
        st: os.stat_result | None = None,
        mapping: mmap.mmap | None = None,
        head: bytes = b"",
        take_fd: bool = False,
    ) -> None:
        self.path = path if isinstance(path, Path) else Path(path)
        self.writable = writable
        label = str(self.path)
        # fd=None: the index opens the file; else the caller's descriptor (and its fstat), which the
        # caller closes, unless take_fd: then the index owns it from here on, also when it raises
        # (the index keeps it until the file is mapped, without the dup and close of a borrowed one)
        own = fd is None or take_fd
        if fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
            except IsADirectoryError:
                raise BadArchiveError(f"{label}: is a directory, not an archive", path=label) from None
        try:
            if st is None:
                st = os.fstat(fd)  # type: ignore[arg-type]
            if not stat.S_ISREG(st.st_mode):
                raise BadArchiveError(f"{label}: not a regular file (a directory or a device)", path=label)
            size = st.st_size
            if size == 0:
                raise BadArchiveError(f"{label}: empty file, not a zip archive", path=label)
            tail = None
            if mapping is None and not writable and not check_local:  # the index from a pread of the tail
                raw = os.pread(fd, min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))  # type: ignore[arg-type]
                tail = parse_tail(raw, size, SMALL_ENTRIES)
                start = tail_start(raw, size, SMALL_ENTRIES) if tail is None else None
                if start is not None and size - start <= _TAIL_MAX:  # a longer central directory
                    tail = parse_tail(os.pread(fd, size - start, start), size, SMALL_ENTRIES)  # type: ignore[arg-type]
            # mapped on first use: the descriptor kept, if the process's cap allows
            if tail is not None and hold_descriptor():
                try:
                    self._fd = fd if own else os.dup(fd)  # type: ignore[arg-type]
                except BaseException:
                    release_descriptor()
                    raise
                self._head = head
                own = False
            elif mapping is None or writable:
                access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
                mapping = mmap.mmap(fd, size, access=access)  # type: ignore[arg-type]
                if not writable:  # (a load's file, cached: its pages mapped ahead from now)
                    map_cached_ahead(mapping, fd)  # type: ignore[arg-type]
            self._map = mapping
        finally:
            if own:
                os.close(fd)  # type: ignore[arg-type]
        self._ident = (st.st_dev, st.st_ino, size)  # to read local headers from the same file
        self._buffer = None  # the numpy view of the mapping: built on first use
        self.size = size
        self._torch = None
        self._untyped = None
        self._rows: list[IndexRow] | None = None
        if tail is not None:
            try:
                self._index_entries(tail[0], False, tail[1], label)
            except BaseException:
                self._drop_fd()  # (a bad archive: no descriptor kept)
                raise
            return
        self._index_entries(eocd.find_end_record(self._mmap, label), check_local)

    @property
    def buffer(self) -> np.ndarray:
        """The whole mapping as a uint8 array (views of it share the mapping)."""
        buf = self._buffer
        if buf is None and getattr(self, "_mmap", None) is not None:
            buf = self._buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        return buf  # type: ignore[return-value]

    @buffer.setter
    def buffer(self, value: np.ndarray | None) -> None:
        self._buffer = value

    @property
    def _cols(self) -> np.ndarray:
        """The index as an int64 array ``(count, len(Col))`` (from the lazy rows: built on first use)."""
        cols = self._cols_np
        if cols is None:
            cols = self._small.array()  # type: ignore[union-attr]
            self._cols_np, self._small = cols, None
        return cols

    @_cols.setter
    def _cols(self, value: np.ndarray) -> None:
        self._cols_np, self._table, self._small = value, None, None

    @property
    def columns(self) -> np.ndarray:
        """The index as an int64 array ``(count, len(Col))``, columns named by
        :class:`~tdz_numba.zipfmt.records.Col` (the array itself: do not write to it)."""
        return self._cols

    @property
    def ident(self) -> tuple[int, int, int] | None:
        """``(st_dev, st_ino, size)`` of the mapped file (local headers are read from that file), or None."""
        return getattr(self, "_ident", None)

    @property
    def table(self) -> np.ndarray:
        """One row per entry, fields named as :class:`tdz_numba.zipfmt.records.Col` (lower case)."""
        table = self._table
        if table is None:
            table = self._table = self._cols.view(records.INDEX_DTYPE)[:, 0]
        return table

    def _index_entries(
        self, end: eocd.EndRecord, check_local: bool, found: Central | None = None, label: str | None = None
    ) -> None:
        """The part of the open that follows the end record (shared with
        :class:`tdz_numba.remote.read.RemoteIndex`): parse the central directory (``found``:
        parsed already, from the tail), check the local headers (``check_local``), decode the
        names, refuse what cannot be read (:func:`tdz_numba.zipfmt.central.check_central`)."""
        self.end = end
        self.local_checked = False
        self._files = None  # directory listings, built on first use
        self._dirs = None
        self._cols_np = None
        self._table = None
        self._small = None
        if found is None:
            found = read_central(self._map if self._map is not None else self.buffer, end)
        if label is None:
            label = str(self.path)
        rows = found.rows
        status = found.status
        cols = None
        if check_local and (status[0] == Status.OK or (status[0] == Status.COUNT and status[1] == end.count)):
            cols = rows.array()  # the local headers are checked before the trailing count, in entry order
            local = self._check_local(cols)
            if local[0] != Status.OK:
                status = tuple(local.tolist())  # type: ignore[assignment]
        self._central = rows
        self.names, self._by_name = check_central(found, label, end, self.size, status)
        if cols is not None:
            self._cols = cols
            self.local_checked = True
        elif len(self.names) > SMALL_ENTRIES and rows.kernel_columns:  # (one name per row)
            self._cols = rows.array()
        else:
            self._small = rows

    def _check_local(self, cols: np.ndarray) -> np.ndarray:
        """Checks every local header into ``cols`` (payload offsets filled); the status.

        As :func:`~tdz_numba.zipfmt.central.check_local_headers` decides: far-apart headers are
        read with one ``pread`` each, whose pages are dropped again when they were not cached
        (:mod:`tdz_numba.files.pagecache`), also in a load: through a mapping advised for
        2 MiB folios, each header's fault would read 2 MiB around it, and a lazy load of a
        cold file would read most of the file before returning (tests/test_cold_readahead.py)."""
        end = self.end
        buf = self.buffer  # (maps the file on first use)
        return check_local_headers(
            buf,
            cols,
            end.cd_offset,
            self.path,
            getattr(self, "_ident", None),
            self.size // max(1, end.count),
        )

    @property
    def mapping(self) -> mmap.mmap | None:
        """The mapping of the whole file (made on first use; None once closed, or remote): a
        reader that makes views of the file shares it rather than mapping the file again."""
        return getattr(self, "_mmap", None)

    def _raise_status(self, status, rows=None) -> None:
        """Raises the error of a kernel's status (:func:`tdz_numba.zipfmt.central.status_error`)."""
        error = status_error(
            status, str(self.path), self.end, self.size, self._cols if rows is None else rows, self._name_at
        )
        if error is not None:
            raise error

    def check_all(self) -> None:
        """Reads and checks every local header now (an open reads them lazily). On a bad
        header it raises and leaves the index as it was (headers still read per entry)."""
        if self.local_checked:
            return
        small = self._small  # rows still lists, headers close together: no columns, no kernel
        near = small is not None and self.size // max(1, self.end.count) < PREAD_SPACING
        mapped = self._mmap if near and type(self) is ArchiveIndex else None
        if mapped is None or not check_small(mapped, small.all(), self.end.cd_offset):  # type: ignore[union-attr]
            cols = self._cols.copy()
            self._raise_status(self._check_local(cols), cols)  # the kernel (or its twin): every header
            self._cols = cols
        self._rows = None
        self.local_checked = True

    def columns_filled(self) -> None:
        """Tells the index that a kernel filled payload offsets into :attr:`table` in place
        (:class:`tdz_numba.archive.verify_pass.CrcPass`): the cached :attr:`rows` are rebuilt on use."""
        self._rows = None

    def payload_offset(self, i: int) -> int:
        """Payload offset of row ``i``, reading and checking its local header on first use."""
        small = self._small
        if small is not None:
            row = small[i]
            offset = row[Col.PAYLOAD_OFFSET]
            if offset >= 0:
                return offset
            with self._header_pages(row[Col.HEADER_OFFSET], row[Col.NAME_LEN]):
                found = resolve_small(self._mmap, row, self.end.cd_offset)
            if found is not None:
                row[Col.PAYLOAD_OFFSET], row[Col.LOCAL_EXTRA_LEN] = found
                if self._rows is not None:
                    self._rows[i] = tuple.__new__(IndexRow, row)  # type: ignore[arg-type]
                return found[0]
            # a bad header: the kernel path below names the problem
        cols = self._cols
        offset = int(cols[i, Col.PAYLOAD_OFFSET])
        if offset >= 0:
            return offset
        from .kernels.dispatch import resolve_local  # the kernel or its twin

        buf = self.buffer
        with self._header_pages(int(cols[i, Col.HEADER_OFFSET]), int(cols[i, Col.NAME_LEN])):
            status = resolve_local(buf, cols, i, self.end.cd_offset)
        self._raise_status(status)
        if self._rows is not None:  # the cached rows see the filled-in local header
            self._rows[i] = tuple.__new__(IndexRow, cols[i].tolist())  # type: ignore[arg-type]
        return int(cols[i, Col.PAYLOAD_OFFSET])

    def _header_pages(self, offset: int, name_len: int) -> pages_only:
        """The advice while one local header is read: its pages only where the archive's entries
        lie far apart (:class:`~tdz_numba.files.scanadvice.pages_only`), else none."""
        far = self.size // max(1, self.end.count) >= SPARSE_SPACING
        stop = offset + int(records.Local.SIZEOF) + name_len + 0xFFFF  # (the extra field's most)
        return pages_only(self._mmap if far else None, offset, stop)

    def row_at(self, i: int) -> IndexRow:
        """Row ``i`` of :attr:`table` as an :class:`~tdz_numba.zipfmt.records.IndexRow`
        (without building :attr:`rows` for every entry)."""
        rows = self._rows
        if rows is not None:
            return rows[i]
        small = self._small
        if small is not None:
            return tuple.__new__(IndexRow, small[i])  # type: ignore[arg-type]
        return tuple.__new__(IndexRow, self._cols[i].tolist())  # type: ignore[arg-type]

    # -- names and directories -------------------------------------------------
    def _name_at(self, i: int) -> str:
        """Entry ``i``'s name decoded from the central directory that was parsed."""
        r = self.row_at(i)
        src: CentralRows = self._central  # type: ignore[assignment]
        start = r.name_offset - src.cd_offset
        raw = bytes(src.cd[start : start + r.name_len])
        return decode_name(raw, r.flags, i, str(self.path), r.name_offset)

    def _build_listing(self) -> None:
        self._files, self._dirs = build_listing(self.names, str(self.path))

    @property
    def files(self) -> dict[str, set[str]]:
        """Files directly under each directory ("" is the root)."""
        if self._files is None:
            self._build_listing()
        return self._files  # type: ignore[return-value]

    @property
    def dirs(self) -> dict[str, set[str]]:
        """Sub-directories directly under each directory ("" is the root)."""
        if self._dirs is None:
            self._build_listing()
        return self._dirs  # type: ignore[return-value]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def row(self, name: str) -> int | None:
        """Row of entry ``name`` in :attr:`table` (None if absent)."""
        return self._by_name.get(name)

    def rows_of(self, names: Iterable[str]) -> list[int | None]:
        """:meth:`row` of many names (one C-level pass: no method call per name)."""
        return list(map(self._by_name.get, names))

    def entry(self, name: str) -> EntryInfo:
        """Location and storage of entry ``name`` (``KeyError`` if absent)."""
        i = self._by_name[name]
        payload = self.payload_offset(i)
        r = self.row_at(i)
        return EntryInfo(
            name, i, r.header_offset, payload, r.csize, r.size, r.method, r.crc, r.flags, r.central_offset
        )

    def digest(self, name: str) -> bytes | None:
        """Entry ``name``'s XXH3-128 digest from its central record (None: it has none)."""
        return None if self._central is None else self._central.digest(self._by_name[name])

    def digest_offset(self, i: int) -> int:
        """Where entry ``i``'s digest lies in the file (-1: none; :class:`records.DigestExtra`)."""
        return -1 if self._central is None else self._central.digest_offset(i)

    @property
    def has_digests(self) -> bool:
        """Whether some entry's central record holds a digest."""
        return self._central is not None and self._central.digests is not None

    def listing(self, directory: str) -> tuple[set[str], set[str]]:
        """``(files, sub-directories)`` directly under ``directory`` ("" is the root)."""
        d = directory.rstrip("/")
        return self.files.get(d, set()), self.dirs.get(d, set())

    def is_dir(self, directory: str) -> bool:
        return directory.rstrip("/") in self.dirs

    # -- payloads ----------------------------------------------------------------
    @property
    def rows(self) -> list[IndexRow]:
        """:attr:`table` as named tuples of Python ints (built on first use, for per-leaf lookups)."""
        if self._rows is None and self._small is not None:
            self._rows = list(map(tuple.__new__, repeat(IndexRow), self._small))  # type: ignore[arg-type]
        if self._rows is None:
            # tuple.__new__ over the row lists: ~0.1 us a row more than plain lists (IndexRow._make: ~0.4 us)
            self._rows = list(map(tuple.__new__, repeat(IndexRow), self._cols.tolist()))  # type: ignore[arg-type]
        return self._rows

    @property
    def torch_untyped(self):
        """The untyped storage of :attr:`torch_storage` (leaves are ``set_`` on it)."""
        if self._untyped is None:
            self._untyped = self.torch_storage.untyped_storage()
        return self._untyped

    @property
    def torch_storage(self):
        """The whole mapping as one uint8 torch tensor (leaves are slices of it)."""
        if self._torch is None:
            import torch

            self._torch = torch.from_numpy(self.buffer)
        return self._torch

    def local_extra(self, e: EntryInfo) -> bytes:
        """The extra field of an entry's local header."""
        self.payload_offset(e.index)
        r = self.row_at(e.index)
        start = r.header_offset + records.Local.SIZEOF + r.name_len
        return self.buffer[start : start + r.local_extra_len].tobytes()

    def inflate(self, entries: list[EntryInfo], num_threads: int | None = None) -> list[np.ndarray]:
        """Inflates DEFLATE entries in parallel (across entries and across the
        segments listed in their segment tables); CRCs are checked."""
        jobs: list[tuple[str, np.ndarray, int, int | None, tuple[int, list[int]] | None]] = []
        for e in entries:
            where = f"{self.path}: entry {e.name!r}"
            table = members.parse_segment_table(self.local_extra(e), where)
            jobs.append((where, self.raw(e), e.size, e.crc, table))
        return members.inflate_many(jobs, num_threads)

    def raw(self, e: EntryInfo) -> np.ndarray:
        """The stored (possibly compressed) bytes of an entry: a view into the map."""
        return self.buffer[e.payload_offset : e.payload_offset + e.compressed_size]

    def read(self, name: str, *, check_crc: bool = True) -> np.ndarray:
        """The uncompressed bytes of an entry (a view when STORED, else a new array).

        Compressed entries are always checked against their CRC; STORED ones
        when ``check_crc``.
        """
        e = self.entry(name)
        raw = self.raw(e)
        if e.method == records.STORED:  # size == compressed size: checked by the index
            data = raw
            if check_crc:
                self.check_crc(e, data)
            return data
        if e.method == records.DEFLATED:
            return self.inflate([e])[0]
        data = codecs.decompress(raw, e.method, e.size, f"{self.path}: entry {name!r}")
        self.check_crc(e, data)
        return data

    def check_crc(self, e: EntryInfo, data: np.ndarray) -> None:
        from zlib_ng import zlib_ng

        found = zlib_ng.crc32(data) if data.size else 0
        if found != e.crc:
            raise ChecksumError(
                f"{self.path}: entry {e.name!r}: CRC-32 mismatch: recorded "
                f"{e.crc:#010x}, computed {found:#010x}",
                path=str(self.path),
                entry=e.name,
                offset=e.payload_offset,
                expected=e.crc,
                found=found,
            )

    def read_bytes(self, name: str) -> bytes:
        """An entry's uncompressed bytes as ``bytes`` (for small files: meta.json)."""
        small = self._small
        if self._fd is not None and small is not None:  # not mapped yet: read with pread
            i = self._by_name[name]
            with MAP_LOCK:  # (the descriptor stays open while it is read)
                fd = self._fd
                data = (
                    None
                    if fd is None
                    else read_small_entry(fd, small, i, self.end.cd_offset, _SMALL_READ, self._head)
                )
            if data is not None:
                if self._rows is not None:  # the cached rows see the filled-in local header
                    self._rows[i] = tuple.__new__(IndexRow, small[i])  # type: ignore[arg-type]
                return data
        mapped = getattr(self, "_mmap", None)  # (a remote index has no mapping)
        if mapped is not None:  # a STORED entry: a slice of the mapping, no numpy, no EntryInfo
            i = self._by_name[name]
            small = self._small
            row = small[i] if small is not None else self.row_at(i)
            if row[Col.METHOD] == records.STORED and row[Col.CSIZE] <= _SMALL_READ:
                start = self.payload_offset(i)
                data = mapped[start : start + row[Col.CSIZE]]
                if crc32(data) == row[Col.CRC]:
                    return data
        return self.read(name).tobytes()  # (a CRC mismatch is raised there)

    def close(self) -> None:
        """Drops this index's references to the mapping; views stay valid."""
        self._buffer = self._torch = self._untyped = self._map = (
            None  # (what the setters of buffer and _mmap do)
        )
        if self._fd is not None:  # not mapped yet: the descriptor kept for the mapping goes
            with MAP_LOCK:
                self._drop_fd()
