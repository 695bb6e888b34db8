"""HDF5 structures read without libhdf5: superblock, header messages, group links.

What :func:`~tdz_numba.formats.hdf5.open_hdf5` needs to know about an object
before h5py may touch it: whether it is a group or a dataset, the links of a
group, and whether a dataset's data live in other files (a virtual layout,
external raw storage) so that it is refused *before* libhdf5 opens it (libhdf5
loops forever on some damaged virtual datasets).

Covered: superblocks version 0-3 (any userblock), object headers version 1
and 2 (:mod:`~tdz_numba.formats.hdf5_headers`), the dataspace, datatype,
layout, external-files, filter-pipeline, link, link-info and symbol-table
messages, and the links of "old-style" groups (symbol table: version 1 B-tree
of group nodes, symbol table nodes, local heap) and "compact" groups (link
messages in the header). "Dense" groups (links in a fractal heap, indexed by a
version 2 B-tree) are listed through h5py's link calls, which read the group's
link storage but open no object. Every address, size and count is checked
against the file, and every walk is bounded (visited sets, node and depth
limits), so a damaged file ends in :class:`~tdz_numba.BadArchiveError`.

Examples
--------
>>> import tempfile, pathlib, numpy as np, h5py
>>> from tdz_numba.formats.hdf5_objects import Layout
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.h5"
...     with h5py.File(p, "w") as f:
...         _ = f.create_dataset("w", data=np.arange(4.0))
...         f["s"] = h5py.SoftLink("/w")
...     buf = np.fromfile(p, np.uint8)
...     lay = Layout.read(buf, str(p))
...     links = lay.links(lay.root, "/")
...     links.names, links.other
(['s', 'w'], {'s': ('soft', '/w')})
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..errors import BadArchiveError
from .hdf5_headers import STATUS_TEXT, header_messages, symbol_table

__all__ = [
    "Layout",
    "Header",
    "Links",
    "SIGNATURE",
    "MAX_LINKS",
    "FIRST_ROWS",
    "first_capacity",
    "heap_names",
]

#: The 8-byte HDF5 superblock signature (at offset 0, 512, 1024, 2048, ...).
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: Most links one group may hold (a claim beyond it is refused).
MAX_LINKS = 10_000_000

# message types
DATASPACE, LINFO, DTYPE, LINK, EXTERNAL, LAYOUT = 0x01, 0x02, 0x03, 0x06, 0x07, 0x08
PIPELINE, ATTR, SYMTAB, AINFO = 0x0B, 0x0C, 0x11, 0x15


def _short(b: bytes, n: int = 60) -> str:
    s = b.decode("utf-8", "replace")
    return s if len(s) <= n else s[:n] + "..."


class Header(NamedTuple):
    """An object's header messages: ``rows[i] = (type, flags, offset, size)``."""

    addr: int
    rows: np.ndarray

    def find(self, mtype: int) -> list[tuple[int, int, int]]:
        """``(flags, offset, size)`` of every message of ``mtype``."""
        return [(int(f), int(p), int(s)) for t, f, p, s in self.rows.tolist() if t == mtype]

    def has(self, mtype: int) -> bool:
        return bool((self.rows[:, 0] == mtype).any())


class Links(NamedTuple):
    """A group's links in order: ``names``, ``addrs`` (absolute object addresses of hard links),
    ``other``: ``name -> (kind, value)`` for the rest (``"soft"``: the path; ``"external"``:
    ``(file, path)`` or None; ``"other"``: a user-defined link)."""

    names: list[str]
    addrs: list[int]
    other: dict[str, tuple[str, Any]]
    #: ``addrs`` as int64 where the symbol table kernel listed them (the walk's scan takes it as it is).
    array: np.ndarray | None = None

    @classmethod
    def of(cls, items: list[tuple[str, str, Any]]) -> Links:
        return cls(
            [n for n, _k, _v in items],
            [v if k == "hard" else -1 for _n, k, v in items],
            {n: (k, v) for n, k, v in items if k != "hard"},
        )


class Layout:
    """One HDF5 file's superblock and readers of its structures (``buf``: the whole file, uint8)."""

    def __init__(self, buf: np.ndarray, where: str, base: int, osz: int, lsz: int, root: int) -> None:
        self.buf = buf
        self.where = where
        self.base = base
        self.osz = osz
        self.lsz = lsz
        self.root = root
        self.size = int(buf.size)
        #: The open's :class:`~tdz_numba.files.scanadvice.header_scan` of the file, if any: a
        #: group's symbol table nodes read page by page where its links are few for the file.
        self.scan: Any = None

    # -- primitives ---------------------------------------------------------------------------------
    def bad(self, what: str) -> BadArchiveError:
        return BadArchiveError(f"{self.where}: {what}")

    def uint(self, pos: int, width: int) -> int:
        """Little-endian unsigned at ``pos`` (-1: all ones, "undefined")."""
        if pos < 0 or pos + width > self.size:
            raise self.bad(f"a {width}-byte field at offset {pos} runs past the end of the file")
        raw = self.buf[pos : pos + width].tobytes()
        if raw == b"\xff" * width:
            return -1
        return int.from_bytes(raw, "little")

    def addr(self, pos: int) -> int:
        """An address field at ``pos``, made absolute (-1: undefined)."""
        a = self.uint(pos, self.osz)
        return -1 if a < 0 else a + self.base

    def bytes_at(self, pos: int, n: int) -> bytes:
        if pos < 0 or n < 0 or pos + n > self.size:
            raise self.bad(f"{n} bytes at offset {pos} run past the end of the file")
        return self.buf[pos : pos + n].tobytes()

    @classmethod
    def read(cls, buf: np.ndarray, where: str) -> Layout:
        """Finds the superblock (offset 0, 512, 1024, ...) and reads its fields."""
        size = int(buf.size)
        sig = np.frombuffer(SIGNATURE, np.uint8)
        off = 0
        while off + 8 <= size and not np.array_equal(buf[off : off + 8], sig):
            off = 512 if off == 0 else off * 2
        if off + 8 > size:
            raise BadArchiveError(f"{where}: no HDF5 superblock signature")
        head = buf[off : off + 96].tobytes()
        if len(head) < 16:
            raise BadArchiveError(f"{where}: the HDF5 superblock is cut short")
        version = head[8]
        if version in (0, 1):
            osz, lsz = head[13], head[14]
            pos = 24 if version == 0 else 28
        elif version in (2, 3):
            osz, lsz = head[9], head[10]
            pos = 12
        else:
            raise BadArchiveError(f"{where}: HDF5 superblock version {version} is not supported")
        if osz not in (2, 4, 8) or lsz not in (2, 4, 8):
            raise BadArchiveError(f"{where}: HDF5 superblock with {osz}-byte offsets, {lsz}-byte lengths")
        lay = cls(buf, where, 0, osz, lsz, -1)
        base = lay.uint(off + pos, osz)
        if base < 0 or base > size:
            raise BadArchiveError(f"{where}: HDF5 base address {base} outside the file")
        lay.base = base
        if version in (0, 1):
            root = lay.addr(
                off + pos + 4 * osz + osz
            )  # after base, free-space, EOF, driver; then name offset
        else:
            root = lay.addr(off + pos + 3 * osz)  # after base, extension, EOF
        if root < 0 or root >= size:
            raise BadArchiveError(f"{where}: the root group's address {root} is outside the file")
        lay.root = root
        return lay

    # -- object headers -----------------------------------------------------------------------------
    def header(self, addr: int) -> Header:
        """The message table of the object header at absolute ``addr``."""
        cap = 256
        while True:
            table = np.empty((cap, 4), np.int64)
            got = int(header_messages(self.buf, addr - self.base, self.base, self.osz, self.lsz, table))
            if got >= 0:
                return Header(addr, table[:got])
            if got != -3 or cap > self.size // 4:
                raise self.bad(f"object header at {addr}: {STATUS_TEXT.get(got, 'damaged')}")
            cap *= 8

    # -- messages -----------------------------------------------------------------------------------
    def dataspace(self, p: int, size: int) -> tuple[int, ...] | None:
        """A dataspace message: the shape (``()`` scalar, ``None`` null)."""
        b = self.bytes_at(p, min(size, 8))
        if len(b) < 4 or b[0] not in (1, 2) or b[1] > 32:
            raise self.bad(f"dataspace message at {p}: version {b[0] if b else '?'}")
        rank = b[1]
        if b[0] == 2:
            if b[3] == 2:
                return None
            if b[3] == 0:
                return ()
            d0 = p + 4
        else:
            d0 = p + 8
        if d0 + rank * self.lsz > p + size:
            raise self.bad(f"dataspace message at {p}: {rank} dims do not fit in {size} bytes")
        return tuple(self.uint(d0 + i * self.lsz, self.lsz) for i in range(rank))

    def layout(self, p: int, size: int) -> tuple[int, int, int, int]:
        """A layout message: ``(version, class, address, size)`` (class 0 compact, 1 contiguous,
        2 chunked, 3 virtual; address/size -1 where the message has none)."""
        b = self.bytes_at(p, min(size, 3))
        if len(b) < 2:
            raise self.bad(f"layout message at {p} is cut short")
        version = b[0]
        if version in (1, 2):
            return version, b[2] if len(b) > 2 else -1, -1, -1
        if version not in (3, 4, 5):
            raise self.bad(f"layout message at {p}: version {version} is not supported")
        cls = b[1]
        if cls == 1 and size >= 2 + self.osz + self.lsz:
            return version, cls, self.addr(p + 2), self.uint(p + 2 + self.osz, self.lsz)
        return version, cls, -1, -1

    def link(self, p: int, size: int) -> tuple[str, str, Any, int]:
        """A link message: ``(name, kind, value, creation order)``; kind ``"hard"`` (value the
        absolute address), ``"soft"`` (the path), ``"external"`` ((file, path)), or ``"other"``."""
        end = p + size
        b = self.bytes_at(p, min(size, 2))
        if len(b) < 2 or b[0] != 1:
            raise self.bad(f"link message at {p}: version {b[0] if b else '?'}")
        flags = b[1]
        pos = p + 2
        kind = 0
        if flags & 0x08:
            kind = self.uint(pos, 1)
            pos += 1
        order = -1
        if flags & 0x04:
            order = self.uint(pos, 8)
            pos += 8
        if flags & 0x10:
            pos += 1
        width = 1 << (flags & 3)
        nlen = self.uint(pos, width)
        pos += width
        if nlen <= 0 or pos + nlen > end:
            raise self.bad(f"link message at {p}: a name of {nlen} bytes")
        name = self.bytes_at(pos, nlen).decode("utf-8", "surrogateescape")
        pos += nlen
        if kind == 0:
            if pos + self.osz > end:
                raise self.bad(f"link {name!r}: address past its message")
            target = self.addr(pos)
            if not 0 <= target < self.size:
                raise self.bad(f"link {name[:60]!r}: address {target} outside the file")
            return name, "hard", target, order
        vlen = self.uint(pos, 2)
        if pos + 2 + vlen > end:
            raise self.bad(f"link {name!r}: a value of {vlen} bytes past its message")
        value = self.bytes_at(pos + 2, vlen)
        if kind == 1:
            return name, "soft", value.split(b"\0", 1)[0].decode("utf-8", "surrogateescape"), order
        if kind == 64:
            parts = value[1:].split(b"\0")
            file = parts[0].decode("utf-8", "surrogateescape")
            obj = parts[1].decode("utf-8", "surrogateescape") if len(parts) > 1 else ""
            return name, "external", (file, obj), order
        return name, "other", None, order

    # -- groups -------------------------------------------------------------------------------------
    def links(self, addr: int, path: str, header: Header | None = None) -> Links | None:
        """The links of the group at ``addr`` in h5py's order (by name, or by creation order when the
        group tracks it); ``None`` when the group keeps them in dense storage (list them with h5py)."""
        h = header or self.header(addr)
        sym = h.find(SYMTAB)
        if sym:
            _f, p, size = sym[0]
            if size < 2 * self.osz:
                raise self.bad(f"group {path!r}: symbol table message of {size} bytes")
            return self._symbol_table(self.addr(p), self.addr(p + self.osz), path)
        tracked = False
        info = h.find(LINFO)
        if info:
            _f, p, size = info[0]
            b = self.bytes_at(p, 2)
            pos = p + 2 + (8 if b[1] & 1 else 0)
            tracked = bool(b[1] & 1)
            if self.addr(pos) != -1:
                return None  # dense storage
        found = [self.link(p, size) for _f, p, size in h.find(LINK)]
        if tracked:
            found.sort(key=lambda x: x[3])
        else:
            found.sort(key=lambda x: x[0].encode("utf-8", "surrogateescape"))
        return Links.of([(n, k, v) for n, k, v, _o in found])

    def _local_heap(self, addr: int, path: str) -> bytes:
        if addr < 0 or self.bytes_at(addr, 4) != b"HEAP":
            raise self.bad(f"group {path!r}: no local heap at {addr}")
        size = self.uint(addr + 8, self.lsz)
        data = self.addr(addr + 8 + 2 * self.lsz)
        if size < 0 or data < 0 or data + size > self.size:
            raise self.bad(f"group {path!r}: local heap of {size} bytes at {data} past the end of the file")
        return self.bytes_at(data, size)

    def _symbol_table(self, btree: int, heap_addr: int, path: str) -> Links:
        heap = self._local_heap(heap_addr, path)
        if self.scan is not None:  # at most as many links as the heap holds strings
            self.scan.decide(self.size / (_strings(heap) + 1))
        if btree < 0 or btree >= self.size:
            raise self.bad(f"group {path!r}: B-tree address {btree} outside the file")
        bound = min(MAX_LINKS, self.size // (2 * self.osz + 24) + 1)
        cap = first_capacity(len(heap), bound)  # (too small for a file of odd names: it grows 8x per try)
        while True:
            rows = np.empty((cap, 4), np.int64)
            got = int(symbol_table(self.buf, btree, self.base, self.osz, self.lsz, rows))
            if got != -3 or cap >= bound:
                break
            cap = min(bound, cap * 8)
        if got < 0:
            raise self.bad(f"group {path!r}: its B-tree or symbol table: {STATUS_TEXT.get(got, 'damaged')}")
        rows = rows[:got]
        if got <= FEW_LINKS:  # a few links: their names found in Python (numpy's ~10 calls cost more)
            return _few_links(self, rows.tolist(), heap, path)
        names = heap_names(heap, rows[:, 0])
        if names is None:
            raise self.bad(f"group {path!r}: a name outside its local heap")
        column = rows[:, 1]
        addrs = column.tolist()
        other: dict[str, tuple[str, Any]] = {}
        for i in np.flatnonzero((rows[:, 2] == 2) | (rows[:, 1] < 0)).tolist():
            name = names[i]
            if rows[i, 2] != 2:
                raise self.bad(f"group {path!r}: {name[:60]!r} at an address outside the file")
            voff = int(rows[i, 3])
            vend = heap.find(b"\0", voff) if 0 <= voff < len(heap) else -1
            if vend < 0:
                raise self.bad(f"group {path!r}: soft link {name[:60]!r} outside its heap")
            other[name] = ("soft", heap[voff:vend].decode("utf-8", "surrogateescape"))
        return Links(names, addrs, other, column)


def _strings(heap: bytes) -> int:
    """How many NUL-ended runs of bytes ``heap`` holds (its names, and a few more for the
    numbers of its free list).

    >>> _strings(b"a\\0\\0\\0bc\\0\\0\\0\\0"), _strings(b"")
    (2, 0)
    """
    a = np.frombuffer(heap, np.uint8)
    if not a.size:
        return 0
    n = int(a[-1] != 0)
    for i in range(0, a.size, _CHUNK):  # (a heap is a claim of the file: temporaries of 1 MiB)
        c = a[i : i + _CHUNK + 1]  # one byte past the chunk: a run that ends at its edge
        n += int(np.count_nonzero((c[:-1] != 0) & (c[1:] == 0)))
    return n


_CHUNK = 1 << 20


#: Rows of the first symbol table tried whatever the heap's size (a larger one: 2 MiB at once cost ~15 us).
FIRST_ROWS = 1 << 12


def first_capacity(heap_len: int, bound: int) -> int:
    """Rows of the first table :meth:`Layout._symbol_table` lists a group into: room for every link
    of a group libhdf5 wrote (its local heap keeps each name 8-byte aligned after the empty name at
    offset 0, so at most ``heap_len // 8`` names), at least :data:`FIRST_ROWS`, at most ``bound``;
    one B-tree walk then lists the group (a table too small is walked again, 8x larger).

    >>> first_capacity(64, 10**6), first_capacity(320_008, 10**6), first_capacity(320_008, 5000)
    (4096, 40002, 5000)
    """
    return min(bound, max(FIRST_ROWS, heap_len // 8 + 1))


def heap_names(heap: bytes, offs: np.ndarray) -> list[str] | None:
    """The names at byte offsets ``offs`` of a local heap: each the bytes from its offset to the
    next NUL, decoded (UTF-8, ``surrogateescape``); None when an offset lies outside the heap or
    no NUL follows it.

    >>> heap_names(b"ab\\0\\0\\0cd\\0", np.array([5, 0, 1]))
    ['cd', 'ab', 'b']
    >>> heap_names(b"ab", np.array([0])) is None
    True
    """
    if not offs.size:
        return []
    hb = np.frombuffer(heap, np.uint8)
    zeros = np.flatnonzero(hb == 0)
    at = np.searchsorted(zeros, offs)  # the NULs before each name
    if offs.min() < 0 or offs.max() >= len(heap) or at.max() >= zeros.size:
        return None
    if ((offs == 0) | (hb[offs - 1] == 0)).all():  # every name starts a NUL-separated piece
        pieces = heap.decode("utf-8", "surrogateescape").split("\0")  # (no NUL inside a character)
        return list(map(pieces.__getitem__, at.tolist()))
    lengths = zeros[at] - offs + 1  # a name inside another one: each name's bytes gathered
    starts = np.cumsum(lengths) - lengths
    idx = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(offs - starts, lengths)
    return hb[idx].tobytes().decode("utf-8", "surrogateescape").split("\0")[:-1]


#: Most links of a symbol table whose names :func:`_few_links` reads (one-dataset open: ~40 us less).
FEW_LINKS = 16


def _few_links(self: Any, rows: list[list[int]], heap: bytes, path: str) -> Links:
    """:meth:`Layout._symbol_table`'s links of a few ``rows`` (``[name offset, address, cache type,
    soft link offset]``): each name the heap's bytes from its offset to the next NUL, the same
    checks and errors (every name first, then soft links and addresses)."""
    names = []
    for off, *_ in rows:
        end = heap.find(b"\0", off) if 0 <= off < len(heap) else -1
        if end < 0:
            raise self.bad(f"group {path!r}: a name outside its local heap")
        names.append(heap[off:end].decode("utf-8", "surrogateescape"))
    other: dict[str, tuple[str, Any]] = {}
    for name, (_, addr, kind, voff) in zip(names, rows):
        if kind != 2 and addr >= 0:
            continue
        if kind != 2:
            raise self.bad(f"group {path!r}: {name[:60]!r} at an address outside the file")
        vend = heap.find(b"\0", voff) if 0 <= voff < len(heap) else -1
        if vend < 0:
            raise self.bad(f"group {path!r}: soft link {name[:60]!r} outside its heap")
        other[name] = ("soft", heap[voff:vend].decode("utf-8", "surrogateescape"))
    return Links(names, [r[1] for r in rows], other)


def dtype_of(lay: Layout, p: int, size: int) -> np.dtype | None:
    """A datatype message as a numpy dtype (numeric, either byte order; h5py's bool enum and
    complex compound), ``None`` for any other type (strings, compound, opaque, ...)."""
    b = lay.bytes_at(p, min(size, 8))
    if len(b) < 8:
        raise lay.bad(f"datatype message at {p} is cut short")
    cls, bits, width = b[0] & 0x0F, int.from_bytes(b[1:4], "little"), int.from_bytes(b[4:8], "little")
    order = ">" if bits & 1 else "<"
    if cls == 0 and width in (1, 2, 4, 8):
        return np.dtype(f"{order}{'i' if bits & 8 else 'u'}{width}")
    if cls == 1 and width in (2, 4, 8) and not bits & 0x40:
        return np.dtype(f"{order}f{width}")
    return None
