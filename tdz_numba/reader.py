"""The reader's index: one mapping of the file, one pass over the central directory.

:class:`ArchiveIndex` maps the whole file once (privately for ``mode="r"``,
shared for ``mode="r+"``), finds the end records, and parses every central
record and local header with the
:func:`~tdz_numba.kernels.parse_central_directory` kernel into arrays. It
knows, for every entry, where its payload is, how it is compressed and its
CRC; and for every directory, which files and sub-directories it holds. It
reads no payload.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.reader import ArchiveIndex
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
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import codecs, records
from .errors import BadArchiveError, ChecksumError, UnsupportedError

__all__ = ["ArchiveIndex", "EntryInfo"]

_STATUS_TEXT = {
    1: "central record signature: expected {expected:#x}, found {found:#x}",
    2: "central record runs past the central directory end ({expected}) to {found}",
    3: "a 0xFFFFFFFF field has no zip64 extra value ({expected} expected)",
    4: "local header offset {found} is outside the data area (< {expected})",
    5: "local header signature: expected {expected:#x}, found {found:#x}",
    6: "local header name differs from the central directory name (length {expected}, at byte {found})",
    7: "payload runs to offset {found}, past the start of the central directory at {expected}",
    8: "payload runs to offset {expected}, overlapping the next local header at {found}",
    9: "the end record lists {expected} entries, the central directory holds "
    "{found_text}",
}


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

    @property
    def has_descriptor(self) -> bool:
        return bool(self.flags & records.FLAG_DESCRIPTOR)


class ArchiveIndex:
    """Index over an archive and the single memory map of its bytes."""

    def __init__(self, path: str | os.PathLike, *, writable: bool = False, check_local: bool = False) -> None:
        self.path = Path(path)
        self.writable = writable
        label = str(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        except IsADirectoryError:
            raise BadArchiveError(f"{label}: is a directory, not an archive") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadArchiveError(f"{label}: not a regular file (a directory or a device)")
            size = st.st_size
            if size == 0:
                raise BadArchiveError(f"{label}: empty file, not a zip archive")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
            self._mmap = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self.size = size
        self._torch = None
        self._untyped = None
        self._rows: list[list[int]] | None = None
        end = records.find_end_record(self.buffer, label)
        self.end = end
        from .kernels import parse_central_directory

        fields, status = parse_central_directory(self.buffer, end.cd_offset, end.cd_size, end.count,
                                                 check_local)  # fmt: skip
        self.fields = fields
        self._raise_status(status)
        self.local_checked = check_local
        # where each record's extent must end: the next local header, or the central directory
        order = np.argsort(fields[:, 5], kind="stable")
        limit = np.empty(len(order), np.int64)
        limit[order[:-1]] = fields[order[1:], 5]
        if len(order):
            limit[order[-1]] = end.cd_offset
        self._limit = limit
        self.names: list[str] = self._decode_names()
        flags, methods = fields[:, 0], fields[:, 1]
        encrypted = np.nonzero(flags & records.FLAG_ENCRYPTED)[0]
        if encrypted.size:
            raise UnsupportedError(f"{label}: entry {self.names[encrypted[0]]!r} is encrypted")
        known = np.zeros(methods.shape, np.bool_)
        for m in records.METHOD_NAMES:
            known |= methods == m
        unknown = np.nonzero(~known)[0]
        if unknown.size:
            i = int(unknown[0])
            raise UnsupportedError(
                f"{label}: entry {self.names[i]!r} uses compression method {int(methods[i])}, "
                f"expected one of {sorted(records.METHOD_NAMES)} (stored, deflate, bzip2, lzma)"
            )
        self._by_name: dict[str, int] = {name: i for i, name in enumerate(self.names)}
        if len(self._by_name) != len(self.names):
            seen: set[str] = set()
            dup = next(n for n in self.names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise BadArchiveError(f"{label}: entry {dup!r} appears twice")
        self._files: dict[str, set[str]] | None = None  # directory listings, built on first use
        self._dirs: dict[str, set[str]] | None = None

    def _raise_status(self, status) -> None:
        code = int(status[0])
        if code:
            i = int(status[1])
            who = self._name_at(i) if code not in (1, 2, 9) else f"entry #{i}"
            found = int(status[3])
            text = _STATUS_TEXT[code].format(expected=int(status[2]), found=found,
                                             found_text="more" if found < 0 else found)  # fmt: skip
            raise BadArchiveError(f"{self.path}: {who}: {text}")

    def check_all(self) -> None:
        """Reads and checks every local header now (an open reads them lazily)."""
        if self.local_checked:
            return
        from .kernels import parse_central_directory

        end = self.end
        fields, status = parse_central_directory(self.buffer, end.cd_offset, end.cd_size, end.count, True)
        self._raise_status(status)
        self.fields = fields
        self._rows = None
        self.local_checked = True

    def payload_offset(self, i: int) -> int:
        """Payload offset of row ``i``, reading and checking its local header on first use."""
        f = self.rows[i]
        if f[8] >= 0:
            return f[8]
        hoff, nlen, csize = f[5], f[7], f[3]
        mm = self._mmap
        sig, lnlen, lelen = struct.unpack_from("<I22xHH", mm, hoff)
        status = None
        if sig != records.LOCAL_SIG:
            status = (5, i, records.LOCAL_SIG, sig)
        elif lnlen != nlen or mm[hoff + 30 : hoff + 30 + nlen] != mm[f[6] : f[6] + nlen]:
            status = (6, i, nlen, lnlen)
        else:
            payload = hoff + 30 + lnlen + lelen
            limit = int(self._limit[i])
            if payload + csize > limit:
                cd = limit == self.end.cd_offset
                status = (7, i, limit, payload + csize) if cd else (8, i, payload + csize, limit)
        if status is not None:
            self._raise_status(status)
        f[8] = payload
        f[12] = lelen
        self.fields[i, 8] = payload
        self.fields[i, 12] = lelen
        return payload

    # -- names and directories -------------------------------------------------
    def _name_at(self, i: int) -> str:
        start, length, flags = int(self.fields[i, 6]), int(self.fields[i, 7]), int(self.fields[i, 0])
        raw = self.buffer[start : start + length].tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            if flags & records.FLAG_UTF8:
                raise BadArchiveError(
                    f"{self.path}: entry #{i} has the UTF-8 flag but its name is not UTF-8: {raw!r}"
                ) from None
        # zip's legacy encoding is cp437; but Info-ZIP stores UTF-8 names without
        # the flag, and meta.json keys are UTF-8, so UTF-8 is tried first
        return raw.decode("cp437")

    def _decode_names(self) -> list[str]:
        """All entry names, sliced from one decoded copy of the central directory."""
        if not len(self.fields):
            return []
        cd0 = self.end.cd_offset
        text = self.buffer[cd0 : cd0 + self.end.cd_size].tobytes().decode("latin-1")  # one char per byte: offsets carry over
        starts = self.fields[:, 6] - cd0
        stops = starts + self.fields[:, 7]
        names = [text[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
        # names with bytes >= 0x80 are UTF-8 (or legacy cp437): decode them properly
        for i, name in enumerate(names):
            if not name.isascii():
                names[i] = self._name_at(i)
        return names

    def _build_listing(self) -> None:
        self._files = files = {"": set()}
        self._dirs = dirs = {"": set()}
        for name in self.names:
            if name.endswith("/"):
                self._add_dir(name.rstrip("/"))
                continue
            parent, _, base = name.rpartition("/")
            if parent not in dirs:
                self._add_dir(parent)
            files[parent].add(base)

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

    def _add_dir(self, d: str) -> None:
        dirs, files = self._dirs, self._files
        while d not in dirs:
            dirs[d] = set()
            files[d] = set()
            parent, _, base = d.rpartition("/")
            self._add_dir(parent)
            dirs[parent].add(base)
            d = parent

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def row(self, name: str) -> int | None:
        """Row of entry ``name`` in :attr:`fields` (None if absent)."""
        return self._by_name.get(name)

    def entry(self, name: str) -> EntryInfo:
        """Location and storage of entry ``name`` (``KeyError`` if absent)."""
        i = self._by_name[name]
        payload = self.payload_offset(i)
        f = self.rows[i]
        return EntryInfo(name, i, f[5], payload, f[3], f[4], f[1], f[2], f[0], f[9])

    def listing(self, directory: str) -> tuple[set[str], set[str]]:
        """``(files, sub-directories)`` directly under ``directory`` ("" is the root)."""
        d = directory.rstrip("/")
        return self.files.get(d, set()), self.dirs.get(d, set())

    def is_dir(self, directory: str) -> bool:
        return directory.rstrip("/") in self.dirs

    # -- payloads ----------------------------------------------------------------
    @property
    def rows(self) -> list[list[int]]:
        """:attr:`fields` as Python lists (built on first use, for per-leaf lookups)."""
        if self._rows is None:
            self._rows = self.fields.tolist()
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
        f = self.fields[e.index]
        start = e.header_offset + 30 + int(f[7])
        return self.buffer[start : start + int(f[12])].tobytes()

    def inflate(self, entries: list[EntryInfo], num_threads: int | None = None) -> list[np.ndarray]:
        """Inflates DEFLATE entries in parallel (across entries and across the
        segments listed in their segment tables); CRCs are checked."""
        jobs = []
        for e in entries:
            where = f"{self.path}: entry {e.name!r}"
            table = codecs.parse_segment_table(self.local_extra(e), where)
            jobs.append((where, self.raw(e), e.size, e.crc, table))
        return codecs.inflate_many(jobs, num_threads)

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
        if e.method == records.STORED:
            if e.size != e.compressed_size:
                raise BadArchiveError(
                    f"{self.path}: entry {name!r} is stored with {e.compressed_size} bytes "
                    f"but records an uncompressed size of {e.size}"
                )
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
                f"{e.crc:#010x}, computed {found:#010x}"
            )

    def read_bytes(self, name: str) -> bytes:
        """An entry's uncompressed bytes as ``bytes`` (for small files: meta.json)."""
        return self.read(name).tobytes()

    def close(self) -> None:
        """Drops this index's references to the mapping; views stay valid."""
        self.buffer = None  # type: ignore[assignment]
        self._torch = self._untyped = None
        self._mmap = None  # type: ignore[assignment]
