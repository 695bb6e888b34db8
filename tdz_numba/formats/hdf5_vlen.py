"""The global heap behind an HDF5 dataset's variable-length data, checked before libhdf5 reads it.

A dataset whose datatype holds variable-length strings or sequences (also as
members of compounds, inside array types, or nested in another sequence)
stores, per value, a 16-byte reference (length, global heap collection
address, object index; 4 + offset size + 4 bytes) to its bytes in a *global
heap collection*. libhdf5 walks a whole collection the first time it reads
from it, and loops forever on some damaged ones (a free-space object of 0
bytes, the bug class of ``tests/fixtures/hdf5_attr_mutant_hang.h5``). So,
before h5py reads such a dataset (or even its creation property list, which
converts a variable-length fill value), :class:`VlenCheck` reads the
dataset's references itself and walks every collection they name with
:func:`~tdz_numba.formats.hdf5_attrs.heap_collection` (every object's index
and size checked, each reference's object present and of the size its length
claims); a damaged collection is a :class:`~tdz_numba.BadArchiveError` naming
the file and the dataset.

Where the references are read:

- compact and contiguous layouts (any layout message version): from the file
  at the data address, every element of the dataspace;
- the fill value (fill value messages, old and new), when it is defined;
- chunked layouts: each allocated chunk, located by libhdf5's chunk index
  (``H5Dchunk_iter``; the index is what libhdf5 walks for any chunked dataset)
  and read from the file by this reader, unfiltered here when its filters are
  deflate, shuffle and Fletcher-32; a chunked dataset with another filter
  (lzf, szip, blosc, ...) is a *limit*: its leaf refuses when read;
- virtual datasets of a variable-length type (their heaps are in other files)
  and datatypes kept in the shared-message heap are limits likewise.

Examples
--------
>>> import tempfile, pathlib, numpy as np, h5py
>>> from tdz_numba.formats.hdf5_objects import Layout
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.h5"
...     with h5py.File(p, "w") as f:
...         f["s"] = np.array(["a", "bc"], dtype=h5py.string_dtype())
...         addr = h5py.h5o.get_info(f["s"].id).addr
...     lay = Layout.read(np.fromfile(p, np.uint8), str(p))
...     check = VlenCheck(lay, lay.header(addr), "/s", {})
...     check.has_vlen, check.contiguous()
(True, 2)
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import numpy as np

from ..errors import BadArchiveError
from .hdf5_attrs import MAX_TYPE_DEPTH, datatype_head
from .hdf5_heap import Collection, heap_collection
from .hdf5_objects import DATASPACE, DTYPE, LAYOUT, Header, Layout

__all__ = ["VlenCheck", "MAX_REFS_PER_ELEMENT", "CHUNK_FILTERS"]

#: Most heap references one element of a datatype may hold (array types multiply them).
MAX_REFS_PER_ELEMENT = 1 << 20
#: Filters this reader undoes to read a chunk's references: deflate, shuffle, Fletcher-32.
CHUNK_FILTERS = {1: "deflate", 2: "shuffle", 3: "fletcher32"}
FILL_OLD, FILL_NEW = 0x04, 0x05

_COMPOUND, _REFERENCE, _ENUM, _VLEN, _ARRAY, _COMPLEX = 6, 7, 8, 9, 10, 11


class _Slot(NamedTuple):
    """Heap references at ``offsets`` of an element; each names ``length * unit`` bytes holding
    ``length`` elements of ``base`` (None: bytes of a string or of numbers, no references)."""

    offsets: np.ndarray
    unit: int
    base: Any


class _VType(NamedTuple):
    size: int
    slots: tuple[_Slot, ...]


class Unchecked(Exception):
    """A datatype whose heap references this reader cannot locate (a limit, not damage)."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _dtype(lay: Layout, p: int, end: int, depth: int = 0) -> tuple[_VType, int]:
    """The datatype message at ``p``: its size, where its heap references sit, where it ends."""
    version, cls, bits, size = datatype_head(lay, p, end, depth)
    q = p + 8
    plain = _VType(size, ())
    if cls in (0, 4):  # integer, bitfield
        return plain, q + 4
    if cls == 1:
        return plain, q + 12
    if cls == 2:
        return plain, q + 2
    if cls == 3:
        return plain, q
    if cls == 5:
        return plain, q + (bits & 0xFF)
    if cls == _REFERENCE:
        if bits & 0x0F >= 2:  # HDF5 1.12+ references: blobs in the global heap, converted on read
            raise Unchecked("references of HDF5 1.12+ (kept in the global heap)")
        return plain, q
    if cls == _ENUM:
        base, q2 = _dtype(lay, q, end, depth + 1)
        n = bits & 0xFFFF
        blob = lay.bytes_at(q2, max(end - q2, 0))
        pos = 0
        for _ in range(n):
            stop = blob.find(b"\0", pos)
            if stop < 0:
                raise lay.bad(f"enum datatype at {p}: a member name runs past its message")
            pos += stop - pos + 1 if version >= 3 else _pad8(stop - pos + 1)
        return plain, q2 + pos + n * base.size
    if cls == _VLEN:
        base, nxt = _dtype(lay, q, end, depth + 1)
        if size != 4 + lay.osz + 4:
            raise lay.bad(f"variable-length datatype at {p} of {size} bytes")
        if bits & 0x0F == 1:  # a string: bytes
            return _VType(size, (_Slot(np.zeros(1, np.int64), 1, None),)), nxt
        return _VType(size, (_Slot(np.zeros(1, np.int64), base.size, base if base.slots else None),)), nxt
    if cls == _ARRAY:
        if version < 2 or q + 1 > end:
            raise Unchecked("an array datatype of version 1")
        rank = lay.uint(q, 1)
        dims_at = q + 1 + (3 if version == 2 else 0)
        q = dims_at + 4 * rank + (4 * rank if version == 2 else 0)
        if rank > 32 or q > end:
            raise lay.bad(f"array datatype at {p}: rank {rank}, its base type past its message")
        count = int(np.prod([lay.uint(dims_at + 4 * i, 4) for i in range(rank)], dtype=object))
        base, nxt = _dtype(lay, q, end, depth + 1)
        return _repeat(lay, p, size, base, count, [0]), nxt
    if cls == _COMPOUND:
        return _compound(lay, p, q, end, bits, size, version, depth)
    if cls == _COMPLEX:
        _base, nxt = _dtype(lay, q, end, depth + 1)
        return plain, nxt
    raise lay.bad(f"datatype at {p}: class {cls}")


def _repeat(lay: Layout, p: int, size: int, base: _VType, count: int, at: list[int]) -> _VType:
    """``count`` elements of ``base`` at each of the offsets ``at`` inside an element of ``size``."""
    if not base.slots:
        return _VType(size, ())
    per = count * len(at) * sum(len(s.offsets) for s in base.slots)
    if per > MAX_REFS_PER_ELEMENT:
        raise Unchecked(f"more than {MAX_REFS_PER_ELEMENT} variable-length values in one element")
    starts = (np.asarray(at, np.int64)[:, None] + np.arange(count, dtype=np.int64) * base.size).ravel()
    slots = []
    for s in base.slots:
        offs = (starts[:, None] + s.offsets[None, :]).ravel()
        if offs.size and int(offs.max()) + 4 + lay.osz + 4 > size:
            raise lay.bad(f"datatype at {p}: its variable-length values run past its {size} bytes")
        slots.append(_Slot(offs, s.unit, s.base))
    return _VType(size, tuple(slots))


def _compound(
    lay: Layout, p: int, q: int, end: int, bits: int, size: int, version: int, depth: int
) -> tuple[_VType, int]:
    n = bits & 0xFFFF
    width = 1 if size < 1 << 8 else 2 if size < 1 << 16 else 3 if size < 1 << 24 else 4
    pos = q
    slots: list[_Slot] = []
    for _ in range(n):
        blob = lay.bytes_at(pos, max(min(end - pos, 65536), 0))
        stop = blob.find(b"\0")
        if stop < 0:
            raise lay.bad(f"compound datatype at {p}: a member name runs past its message")
        if version >= 3:
            offset = lay.uint(pos + stop + 1, width)
            pos += stop + 1 + width
            count = 1
        else:
            pos += _pad8(stop + 1)
            offset = lay.uint(pos, 4)
            count = 1
            if version == 1:
                ndims = lay.uint(pos + 4, 1)
                dims = [lay.uint(pos + 16 + 4 * i, 4) for i in range(min(ndims, 4))]
                count = int(np.prod(dims, dtype=object)) if ndims else 1
                pos += 28
            pos += 4
        member, pos = _dtype(lay, pos, end, depth + 1)
        if member.slots:
            slots.extend(_repeat(lay, p, size, member, count, [offset]).slots)
    return _VType(size, tuple(slots)), pos


def _unfilter(
    data: bytes, filters: list[tuple[int, tuple[int, ...]]], mask: int, nbytes: int, where: str
) -> bytes:
    for i in reversed(range(len(filters))):
        if mask & (1 << i):
            continue
        code, values = filters[i]
        if code == 1:
            d = zlib.decompressobj()
            try:
                data = d.decompress(data, nbytes + 1)
            except zlib.error as e:
                raise BadArchiveError(f"{where}: a chunk does not inflate: {e}") from None
        elif code == 2:
            es = values[0] if values else 1
            n = len(data) // es if es > 0 else 0
            if n:
                body = np.frombuffer(data, np.uint8, n * es).reshape(es, n).T.tobytes()
                data = body + data[n * es :]
        elif code == 3:
            data = data[:-4]
    return data


class VlenCheck:
    """The variable-length references of one dataset (header ``h``, path ``name`` for errors).

    Parsing the header raises :class:`~tdz_numba.BadArchiveError` for a damaged datatype and
    checks the fill value's references; :meth:`contiguous` checks compact and contiguous data,
    :meth:`chunked` the chunks of a dataset h5py has opened (it does not read them). ``limit``
    is set (why) when the references cannot be located.
    """

    def __init__(self, lay: Layout, h: Header, name: str, heaps: dict[int, Any]) -> None:
        self.lay, self.h, self.name, self.heaps = lay, h, name, heaps
        self.limit = ""
        self.vt: _VType | None = None
        self._seen: set[tuple[int, int, int]] = set()
        dts = h.find(DTYPE)
        if not dts:
            return
        flags, p, size = dts[0]
        try:
            if flags & 0x02:
                at = self._committed(p, size)
                if at is None:
                    self.limit = "its datatype is in the shared-message heap"
                    return
                p, size = at
            self.vt = _dtype(lay, p, p + size)[0]
        except Unchecked as e:
            self.limit = str(e)
            return
        if self.has_vlen:
            self._fill()

    @property
    def has_vlen(self) -> bool:
        """Whether the dataset's values hold heap references (unknown types count as holding them)."""
        return bool(self.limit) or (self.vt is not None and bool(self.vt.slots))

    def _bad(self, e: BadArchiveError) -> BadArchiveError:
        msg = str(e).removeprefix(self.lay.where + ": ")
        return self.lay.bad(f"dataset {self.name[:80]!r}: {msg}")

    def _committed(self, p: int, size: int) -> tuple[int, int] | None:
        lay = self.lay
        version, kind = lay.uint(p, 1), lay.uint(p + 1, 1)
        if version == 3 and kind == 1:
            return None
        at = p + (8 if version == 1 else 2)
        if version not in (1, 2, 3) or at + lay.osz > p + size:
            raise lay.bad(f"dataset {self.name!r}: a shared datatype of version {version}")
        addr = lay.addr(at)
        if not 0 <= addr < lay.size:
            raise lay.bad(f"dataset {self.name!r}: its committed datatype at {addr} is outside the file")
        found = lay.header(addr).find(DTYPE)
        if not found or found[0][0] & 0x02:
            raise lay.bad(f"dataset {self.name!r}: no datatype in the committed datatype at {addr}")
        return found[0][1], found[0][2]

    def _fill(self) -> None:
        lay, vt = self.lay, self.vt
        assert vt is not None
        raw = b""
        new = self.h.find(FILL_NEW)
        if new:
            _f, p, size = new[0]
            b = lay.bytes_at(p, min(size, 4))
            version = b[0] if b else 0
            if version in (1, 2) and size >= 4:
                defined = b[3]
                if version == 1 or defined == 1:
                    raw = self._fill_value(p + 4, p + size)
            elif version == 3 and size >= 2:
                if b[1] & 0x20:
                    raw = self._fill_value(p + 2, p + size)
            else:
                raise lay.bad(f"dataset {self.name!r}: fill value message version {version}")
        else:
            old = self.h.find(FILL_OLD)
            if old:
                _f, p, size = old[0]
                raw = self._fill_value(p, p + size)
        if raw:
            if len(raw) != vt.size:
                raise lay.bad(
                    f"dataset {self.name!r}: a fill value of {len(raw)} bytes, its type has {vt.size}"
                )
            self._check(np.frombuffer(raw, np.uint8), vt, 1)

    def _fill_value(self, p: int, end: int) -> bytes:
        if p + 4 > end:
            return b""
        n = self.lay.uint(p, 4)
        if n < 0 or p + 4 + n > end:
            raise self.lay.bad(f"dataset {self.name!r}: a fill value of {n} bytes past its message")
        return self.lay.bytes_at(p + 4, n)

    def _count(self) -> int | None:
        space = self.h.find(DATASPACE)
        if not space or space[0][0] & 0x02:
            return None
        shape = self.lay.dataspace(space[0][1], space[0][2])
        return 0 if shape is None else int(np.prod(shape, dtype=object))

    def contiguous(self) -> int | None:
        """Checks the references of a compact or contiguous dataset; the number of elements
        checked, None for another layout (chunked, virtual: see :meth:`chunked`)."""
        lay, vt = self.lay, self.vt
        if vt is None or not vt.slots:
            return 0
        found = self.h.find(LAYOUT)
        if not found:
            return 0
        _f, p, size = found[0]
        b = lay.bytes_at(p, min(size, 3))
        if len(b) < 3:
            raise lay.bad(f"dataset {self.name!r}: layout message at {p} is cut short")
        count = self._count()
        if b[0] in (1, 2):
            cls, ndims = b[2], b[1]
            dims_at = p + 8 + (lay.osz if cls else 0)
            if cls == 0:
                at = dims_at + 4 * ndims
                start, nbytes = at + 4, lay.uint(at, 4)
            elif cls == 1:
                start = lay.addr(p + 8)
                nbytes = -1
            else:
                return None
        elif b[0] in (3, 4, 5):
            cls = b[1]
            if cls == 0:
                start, nbytes = p + 4, lay.uint(p + 2, 2)
            elif cls == 1:
                start, nbytes = lay.addr(p + 2), lay.uint(p + 2 + lay.osz, lay.lsz)
            else:
                return None
        else:
            raise lay.bad(f"dataset {self.name!r}: layout message version {b[0]}")
        if start < 0 or start >= lay.size:
            return 0  # not allocated (fill value only), or past the file: libhdf5 reads no reference
        avail = (lay.size - start) if nbytes < 0 else min(nbytes, lay.size - start)
        n = avail // vt.size if count is None else min(count, avail // vt.size)
        self._check(lay.buf[start : start + n * vt.size], vt, n)
        return n

    def chunked(self, dset: Any) -> int:
        """Checks the references of every allocated chunk of the h5py dataset ``dset`` (this
        dataset, opened; its data not read); the number of chunks. Sets :attr:`limit` and
        checks nothing when a filter is not one of :data:`CHUNK_FILTERS`."""
        lay, vt = self.lay, self.vt
        if vt is None or not vt.slots:
            return 0
        try:
            plist = dset.id.get_create_plist()
            filters = []
            for i in range(plist.get_nfilters()):
                code, _flags, values, _name = plist.get_filter(i)
                if code not in CHUNK_FILTERS:
                    self.limit = (
                        f"variable-length data in chunks with filter {code}: "
                        "only deflate, shuffle and fletcher32 are checked"
                    )
                    return 0
                filters.append((code, tuple(values)))
            nbytes = int(np.prod(plist.get_chunk(), dtype=object)) * vt.size
            chunks: list[Any] = []
            dset.id.chunk_iter(chunks.append)
        except Exception as e:  # noqa: BLE001 - h5py raises many kinds on damaged chunk indexes
            raise self.lay.bad(f"dataset {self.name[:80]!r}: cannot list its chunks: {e}") from None
        for info in chunks:
            start, size = int(info.byte_offset), int(info.size)
            if start < 0 or size < 0 or start + size > lay.size:
                continue  # libhdf5 reads no reference there
            data = lay.buf[start : start + size].tobytes()
            if filters:
                try:
                    data = _unfilter(data, filters, int(info.filter_mask), nbytes, lay.where)
                except BadArchiveError as e:
                    raise self._bad(e) from None
            n = min(len(data), nbytes) // vt.size
            self._check(np.frombuffer(data, np.uint8, n * vt.size), vt, n)
        return len(chunks)

    # -- the references ---------------------------------------------------------------------------
    def _check(self, raw: np.ndarray, vt: _VType, n: int, depth: int = 0) -> None:
        try:
            self._refs(raw, vt, n, depth)
        except BadArchiveError as e:
            if str(e).startswith(f"{self.lay.where}: dataset "):
                raise
            raise self._bad(e) from None

    def _refs(self, raw: np.ndarray, vt: _VType, n: int, depth: int) -> None:
        lay = self.lay
        osz = lay.osz
        width = 4 + osz + 4
        if n <= 0:
            return
        rows = np.asarray(raw[: n * vt.size], np.uint8).reshape(n, vt.size)
        for slot in vt.slots:
            cols = (slot.offsets[:, None] + np.arange(width)).ravel()
            refs = rows[:, cols].reshape(-1, width)
            length = refs[:, :4].copy().view("<u4").ravel().astype(np.int64)
            wide = np.zeros((len(refs), 8), np.uint8)
            wide[:, :osz] = refs[:, 4 : 4 + osz]
            addr = wide.view("<u8").ravel()
            idx = refs[:, 4 + osz :].copy().view("<u4").ravel().astype(np.int64)
            used = addr != 0
            if not used.any():
                continue
            addr, idx, length = addr[used], idx[used], length[used]
            if int(addr.max()) >= lay.size:
                raise lay.bad(f"a heap reference to address {int(addr.max())} past the end of the file")
            want = length * slot.unit
            order = np.argsort(addr, kind="stable")  # the references of one collection side by side
            addr, idx, length, want = addr[order], idx[order], length[order], want[order]
            cuts = [0, *(np.flatnonzero(np.diff(addr)) + 1).tolist(), len(addr)]
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                a = int(addr[lo])
                self._collection(a, idx[lo:hi], length[lo:hi], want[lo:hi], slot.base, depth)

    def _collection(
        self, a: int, idx: np.ndarray, length: np.ndarray, want: np.ndarray, base: Any, depth: int
    ) -> None:
        """Checks references to the collection at (relative) address ``a``: each object there,
        of the size its reference claims."""
        lay = self.lay
        col = heap_collection(lay, a + lay.base, self.heaps)
        at = np.searchsorted(col.index, idx)
        hit = at < col.index.size
        hit[hit] = col.index[at[hit]] == idx[hit]
        if not hit.all():
            raise lay.bad(f"no object {int(idx[~hit][0])} in the global heap collection at {a}")
        sizes = col.size[at]
        bad = np.flatnonzero(sizes != want)
        if bad.size:
            i = int(bad[0])
            raise lay.bad(
                f"global heap collection at {a}: object {int(idx[i])} holds {int(sizes[i])} "
                f"bytes, its reference claims {int(want[i])}"
            )
        if base is not None:
            self._nested(a, col, idx, length, base, depth)

    def _nested(
        self, a: int, col: Collection, idx: np.ndarray, length: np.ndarray, base: _VType, depth: int
    ) -> None:
        """The references inside the heap objects of a sequence of a type that holds some."""
        if depth >= MAX_TYPE_DEPTH:
            raise self.lay.bad(f"variable-length values nested deeper than {MAX_TYPE_DEPTH}")
        for i, count in zip(idx.tolist(), length.tolist()):
            key = (a, i, id(base))
            if key in self._seen or not count:
                continue
            self._seen.add(key)
            pos, size = col.get(i) or (0, -1)  # present: checked by _collection
            if count * base.size != size:
                raise self.lay.bad(
                    f"global heap collection at {a}: object {i} holds {size} bytes, not {count} values"
                )
            self._refs(self.lay.buf[pos : pos + size], base, count, depth + 1)
