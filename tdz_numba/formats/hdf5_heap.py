"""HDF5 global heap collections walked without libhdf5, every claim checked.

Variable-length strings and sequences (of attributes and datasets) keep their
bytes in *global heap collections* (``"GCOL"``, version 1, a size, then objects
of an index and a size each, 8-byte aligned). libhdf5 walks a whole collection
the first time it reads from it and loops forever on some damaged ones (a
free-space object of 0 bytes, ``tests/fixtures/hdf5_attr_mutant_hang.h5``), so
this reader walks each collection itself first: :func:`heap_collection` with
the Numba kernel :func:`~tdz_numba.formats.hdf5_headers.global_heap`, its
statuses worded here as :class:`~tdz_numba.BadArchiveError` naming the file and
the collection. :func:`walk_collection` is the same walk in plain Python: the
reference the kernel is tested against (``tests/test_formats_hdf5_heap.py``).

Examples
--------
>>> import numpy as np
>>> from tdz_numba.formats.hdf5_objects import Layout
>>> buf = np.zeros(64, np.uint8)
>>> buf[:5] = list(b"GCOL") + [1]; buf[8] = 64              # a 64-byte collection, 8-byte sizes
>>> buf[16:18] = [1, 0]; buf[24] = 5; buf[32:37] = list(b"hello")   # object 1: 5 bytes
>>> buf[48] = 24                                              # then 24 bytes of free space
>>> lay = Layout(buf, "x.h5", base=0, osz=8, lsz=8, root=0)
>>> col = heap_collection(lay, 0, {})
>>> col.index.tolist(), col.get(1), lay.bytes_at(*col.get(1)), col.end
([1], (32, 5), b'hello', 64)
>>> col == walk_collection(lay, 0)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .hdf5_headers import (
    G_CUT,
    G_FULL,
    G_NONE,
    G_PAST,
    G_SIZE,
    G_TWICE,
    G_UNDEF,
    G_VERSION,
    G_ZERO,
    global_heap,
)
from .hdf5_objects import Layout

__all__ = ["Collection", "heap_collection", "walk_collection"]

_FIRST_CAP = 4096  # rows of the kernel's first output table (a 64 KiB collection of short strings)


@dataclass(frozen=True, eq=False)
class Collection:
    """The objects of one global heap collection, by index: ``index`` (sorted), ``pos``
    (absolute offset of each object's bytes), ``size`` (int64 arrays), and ``end``, the
    absolute offset past the collection."""

    index: np.ndarray
    pos: np.ndarray
    size: np.ndarray
    end: int

    def get(self, i: int) -> tuple[int, int] | None:
        """``(offset, size)`` of object ``i``, None when the collection has none."""
        at = int(np.searchsorted(self.index, i))
        if at < self.index.size and int(self.index[at]) == i:
            return int(self.pos[at]), int(self.size[at])
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Collection):
            return NotImplemented
        pairs = zip((self.index, self.pos, self.size), (other.index, other.pos, other.size))
        return self.end == other.end and all(np.array_equal(a, b) for a, b in pairs)


def _sorted(rows: np.ndarray, end: int) -> Collection:
    order = np.argsort(rows[:, 0], kind="stable")
    r = rows[order]
    return Collection(
        np.ascontiguousarray(r[:, 0]), np.ascontiguousarray(r[:, 1]), np.ascontiguousarray(r[:, 2]), end
    )


def heap_collection(lay: Layout, addr: int, heaps: dict[int, Any]) -> Collection:
    """The objects of the global heap collection at absolute ``addr``, walked by the kernel
    (``heaps`` caches the collections of the file, by address).

    Raises :class:`~tdz_numba.BadArchiveError` for a collection libhdf5 would misread or loop on
    (a free-space object of 0 bytes, an object past the collection, a size past the file), with
    the words of :func:`walk_collection`.
    """
    got = heaps.get(addr)
    if got is not None:
        return got
    lsz = lay.lsz
    info = np.zeros(3, np.int64)
    if not 0 <= addr <= lay.size - 8:  # also keeps the address an int64
        raise _error(lay, addr, G_NONE, info)
    out = np.empty((_FIRST_CAP, 3), np.int64)
    n = int(global_heap(lay.buf, addr, lsz, out, info))
    if n == G_FULL:  # a collection of many small objects: room for all it can hold
        out = np.empty((int(info[0]) // (8 + lsz) + 1, 3), np.int64)
        n = int(global_heap(lay.buf, addr, lsz, out, info))
    if n < 0:
        raise _error(lay, addr, n, info)
    col = _sorted(out[:n], addr + int(info[0]))
    heaps[addr] = col
    return col


def _error(lay: Layout, addr: int, status: int, info: np.ndarray) -> Exception:
    """The error of :func:`walk_collection` for the kernel's ``status``."""
    where = f"global heap collection at {addr}"
    ones = (1 << (8 * lay.lsz)) - 1
    csize, idx, osize = (int(v) & ((1 << 64) - 1) for v in info)
    if status == G_NONE:
        return lay.bad(f"{where}: no collection there")
    if status == G_VERSION:
        return lay.bad(f"{where}: version {-1 if idx == 255 else idx}")
    if status == G_CUT:
        return lay.bad(f"a {lay.lsz}-byte field at offset {addr + 8} runs past the end of the file")
    if status == G_SIZE:
        return lay.bad(f"{where}: a size of {-1 if csize == ones else csize} bytes past the end of the file")
    if status == G_UNDEF:
        return lay.bad(f"{where}: object {idx} of an undefined size")
    if status == G_TWICE:
        return lay.bad(f"{where}: object {idx} twice")
    if status == G_ZERO:
        return lay.bad(f"{where}: a free-space object of 0 bytes (libhdf5 loops on it)")
    if status == G_PAST:
        return lay.bad(f"{where}: object {idx} of {osize} bytes runs past the collection")
    return lay.bad(f"{where}: status {status}")  # pragma: no cover - no other status


def walk_collection(lay: Layout, addr: int) -> Collection:
    """:func:`heap_collection` in plain Python, uncached: the reference of the kernel's tests."""
    where = f"global heap collection at {addr}"
    if not 0 <= addr <= lay.size - 8 or lay.bytes_at(addr, 4) != b"GCOL":
        raise lay.bad(f"{where}: no collection there")
    if lay.uint(addr + 4, 1) != 1:
        raise lay.bad(f"{where}: version {lay.uint(addr + 4, 1)}")
    csize = lay.uint(addr + 8, lay.lsz)
    hdr = 8 + lay.lsz
    if csize < hdr or addr + csize > lay.size:
        raise lay.bad(f"{where}: a size of {csize} bytes past the end of the file")
    blob = lay.bytes_at(addr, csize)
    lsz, undefined = lay.lsz, (1 << (8 * lay.lsz)) - 1
    p = hdr  # offsets in the collection from here on
    objs: dict[int, tuple[int, int]] = {}
    while p + hdr <= csize:  # what is left past the last header is free space
        idx = int.from_bytes(blob[p : p + 2], "little")
        osize = int.from_bytes(blob[p + 8 : p + 8 + lsz], "little")
        if osize == undefined:
            raise lay.bad(f"{where}: object {idx} of an undefined size")
        if idx > 0:
            if idx in objs:
                raise lay.bad(f"{where}: object {idx} twice")
            objs[idx] = (addr + p + hdr, osize)
            need = hdr + ((osize + 7) & ~7)
        elif osize == 0:
            raise lay.bad(f"{where}: a free-space object of 0 bytes (libhdf5 loops on it)")
        else:
            need = osize
        if need > csize - p:
            if idx > 0:
                raise lay.bad(f"{where}: object {idx} of {osize} bytes runs past the collection")
            break
        p += need
    rows = np.array([(k, *v) for k, v in objs.items()], np.int64).reshape(-1, 3)
    return _sorted(rows, addr + csize)
