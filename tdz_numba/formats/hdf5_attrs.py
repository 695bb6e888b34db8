"""HDF5 attributes read without libhdf5: attribute messages, their datatypes and the global heap.

:func:`read_attributes` decodes the attribute messages (type ``0x000C``) of one
object header itself, each claim checked against its message and the file:

- numbers: integers (1, 2, 4, 8 bytes, signed or not) and IEEE floats (half,
  single, double), either byte order, scalars and arrays;
- fixed-length strings (libhdf5's padding rules: null-terminated strings end at
  the first NUL, space-padded ones lose their trailing spaces) and
  variable-length strings, whose bytes live in *global heap collections*: each
  collection is walked the way libhdf5 walks it, every object's size and index
  checked, and a collection libhdf5 would loop on (a free-space object of 0
  bytes, as in ``tests/fixtures/hdf5_attr_mutant_hang.h5``) is refused;
- h5py's booleans (an enum of ``FALSE = 0``, ``TRUE = 1``) and variable-length
  sequences of numbers (through the heap likewise).

Values come out as h5py's value made plain
(:func:`~tdz_numba.formats.hdf5_h5py.plain`): numbers as Python scalars or
nested lists, strings as ``str``, arrays of strings as flat lists. Any other
type (compound, array, opaque, other enums, non-IEEE numbers, a null dataspace)
is *well-formed* once its message has been parsed and holds no heap reference:
those are read by h5py, one attribute by name. An attribute that holds heap
references in a type this reader does not decode (references, variable-length
members of compounds), or whose type or message is shared in the file's
shared-message heap, is left out with its reason (:class:`Attrs`). Attributes
kept in *dense* storage (a fractal heap named by the attribute-info message,
objects with many or large attributes in files written with
``libver="latest"``) are listed and read by h5py.

Examples
--------
>>> import tempfile, pathlib, numpy as np, h5py
>>> from tdz_numba.formats.hdf5_objects import Layout
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.h5"
...     with h5py.File(p, "w") as f:
...         f.attrs["n"] = np.arange(3, dtype=">i2"); f.attrs["s"] = "text"; f.attrs["b"] = True
...     lay = Layout.read(np.fromfile(p, np.uint8), str(p))
...     got = read_attributes(lay, lay.header(lay.root), "/", {})
>>> got.values, got.h5py, got.skipped, got.dense
({'b': True, 'n': [0, 1, 2], 's': 'text'}, [], {}, False)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .hdf5_heap import Collection, heap_collection
from .hdf5_objects import AINFO, ATTR, DTYPE, Header, Layout

__all__ = ["Attrs", "read_attributes", "heap_collection", "datatype_head", "MAX_TYPE_DEPTH"]

#: Deepest nesting of datatypes (compound members, array and sequence bases) read.
MAX_TYPE_DEPTH = 16


def datatype_head(lay: Layout, p: int, end: int, depth: int) -> tuple[int, int, int, int]:
    """The 8-byte head of the datatype message at ``p`` (within ``end``, nested ``depth`` deep):
    ``(version, class, class bits, size)``, checked; the class's properties follow at ``p + 8``."""
    if depth > MAX_TYPE_DEPTH:
        raise lay.bad(f"datatype at {p}: nested deeper than {MAX_TYPE_DEPTH}")
    if p + 8 > end:
        raise lay.bad(f"datatype at {p} runs past its message")
    b = lay.bytes_at(p, 8)
    version, cls = b[0] >> 4, b[0] & 0x0F
    bits = int.from_bytes(b[1:4], "little")
    size = int.from_bytes(b[4:8], "little")
    if version not in (1, 2, 3, 4, 5) or size == 0:
        raise lay.bad(f"datatype at {p}: version {version}, {size} bytes")
    return version, cls, bits, size


_FIXED, _FLOAT, _TIME, _STRING, _BITFIELD, _OPAQUE, _COMPOUND = 0, 1, 2, 3, 4, 5, 6
_REFERENCE, _ENUM, _VLEN, _ARRAY, _COMPLEX = 7, 8, 9, 10, 11
#: IEEE layouts: size -> (sign bit, exponent location, exponent size, mantissa location and size, bias).
_IEEE = {2: (15, 10, 5, 0, 10, 15), 4: (31, 23, 8, 0, 23, 127), 8: (63, 52, 11, 0, 52, 1023)}


class _Type(NamedTuple):
    """A datatype: ``kind`` is ``"num"`` (``dtype`` set), ``"bool"``, ``"str"`` (fixed, ``pad``),
    ``"vstr"``, ``"vseq"`` (``base``), ``"h5py"`` (h5py reads it) or ``"skip"`` (``why``)."""

    kind: str
    size: int
    dtype: Any = None
    pad: int = 0
    base: Any = None
    why: str = ""
    heap: bool = False  # holds global heap references somewhere


class Attrs(NamedTuple):
    """One object's attributes: ``values`` decoded here (h5py's order), ``h5py``: names h5py must
    read (well-formed, of a type not decoded here), ``skipped``: name -> why it is left out,
    ``dense``: the attributes live in dense storage (h5py lists and reads them all)."""

    values: dict[str, Any]
    h5py: list[str]
    skipped: dict[str, str]
    dense: bool
    order: list[str]


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class _Reader:
    def __init__(self, lay: Layout, heaps: dict[int, Any]) -> None:
        self.lay = lay
        self.heaps = heaps

    # -- datatypes --------------------------------------------------------------------------------
    def dtype(self, p: int, end: int, depth: int = 0) -> tuple[_Type, int | None]:
        """The datatype message at ``p`` (within ``end``): its type and where it ends (None: unknown)."""
        lay = self.lay
        version, cls, bits, size = datatype_head(lay, p, end, depth)
        q = p + 8
        order = ">" if bits & 1 else "<"
        if cls == _FIXED:
            if q + 4 > end:
                raise lay.bad(f"integer datatype at {p} runs past its message")
            offset, prec = lay.uint(q, 2), lay.uint(q + 2, 2)
            plain = size in (1, 2, 4, 8) and offset == 0 and prec == 8 * size and not bits & 0x06
            if plain:
                return _Type("num", size, np.dtype(f"{order}{'i' if bits & 8 else 'u'}{size}")), q + 4
            return _Type("h5py", size), q + 4
        if cls == _FLOAT:
            if q + 12 > end:
                raise lay.bad(f"float datatype at {p} runs past its message")
            f = lay.bytes_at(q, 12)
            got = ((bits >> 8) & 0xFF, f[4], f[5], f[6], f[7], int.from_bytes(f[8:12], "little"))
            offset, prec = int.from_bytes(f[0:2], "little"), int.from_bytes(f[2:4], "little")
            ieee = _IEEE.get(size) == got and offset == 0 and prec == 8 * size
            if ieee and not bits & 0x4E and (bits >> 4) & 3 == 2:  # LE/BE, no padding bits, implied msb
                return _Type("num", size, np.dtype(f"{order}f{size}")), q + 12
            return _Type("h5py", size), q + 12
        if cls == _STRING:
            if bits & 0x0F > 2 or (bits >> 4) & 0x0F > 1:
                return _Type("h5py", size), q
            return _Type("str", size, pad=bits & 0x0F), q
        if cls in (_TIME, _BITFIELD):
            n = 2 if cls == _TIME else 4
            return _Type("h5py", size), (q + n if q + n <= end else None)
        if cls == _OPAQUE:
            n = bits & 0xFF
            return _Type("h5py", size), (q + n if q + n <= end else None)
        if cls == _REFERENCE:
            return _Type("skip", size, why="an object or region reference", heap=True), None
        if cls == _ENUM:
            return self._enum(p, q, end, bits, size, version, depth)
        if cls == _VLEN:
            base, nxt = self.dtype(q, end, depth + 1)
            if bits & 0x0F == 1:
                if size != 4 + lay.osz + 4:
                    raise lay.bad(f"variable-length string datatype at {p} of {size} bytes")
                return _Type("vstr", size, heap=True), nxt
            if bits & 0x0F == 0 and base.kind == "num" and size == 4 + lay.osz + 4:
                return _Type("vseq", size, base=base, heap=True), nxt
            return _Type("skip", size, why="a variable-length sequence of a type not read", heap=True), nxt
        if cls == _ARRAY:
            if version < 2 or q + 1 > end:
                return _Type("skip", size, why="an array datatype of version 1"), None
            rank = lay.uint(q, 1)
            q += 1 + (3 if version == 2 else 0) + 4 * rank + (4 * rank if version == 2 else 0)
            if rank > 32 or q > end:
                raise lay.bad(f"array datatype at {p}: rank {rank}, its base type past its message")
            base, nxt = self.dtype(q, end, depth + 1)
            return self._wrap(size, base, nxt)
        if cls == _COMPOUND:
            return self._compound(p, q, end, bits, size, version, depth)
        if cls == _COMPLEX:
            base, nxt = self.dtype(q, end, depth + 1)
            return self._wrap(size, base, nxt)
        raise lay.bad(f"datatype at {p}: class {cls}")

    @staticmethod
    def _wrap(size: int, inner: _Type, nxt: int | None) -> tuple[_Type, int | None]:
        if inner.heap or inner.kind == "skip":
            why = inner.why or "variable-length members"
            return _Type("skip", size, why=why, heap=inner.heap), nxt
        return _Type("h5py", size), nxt

    def _enum(
        self, p: int, q: int, end: int, bits: int, size: int, version: int, depth: int
    ) -> tuple[_Type, int | None]:
        lay = self.lay
        base, q2 = self.dtype(q, end, depth + 1)
        if q2 is None or base.kind != "num" or base.dtype.kind not in "iu":
            return _Type("h5py", size), None  # an integer base this reader does not decode
        n = bits & 0xFFFF
        blob = lay.bytes_at(q2, end - q2)
        names = []
        pos = 0
        for _ in range(n):
            stop = blob.find(b"\0", pos)
            if stop < 0:
                raise lay.bad(f"enum datatype at {p}: a member name runs past its message")
            names.append(blob[pos:stop])
            pos += stop - pos + 1 if version >= 3 else _pad8(stop - pos + 1)
        if pos + n * base.size > len(blob):
            raise lay.bad(f"enum datatype at {p}: {n} values run past its message")
        values = np.frombuffer(blob, base.dtype, n, pos).tolist()
        nxt = q2 + pos + n * base.size
        if len(names) == 2 and dict(zip(names, values)) == {b"FALSE": 0, b"TRUE": 1}:
            return _Type("bool", size, dtype=base.dtype), nxt
        return _Type("h5py", size), nxt

    def _compound(
        self, p: int, q: int, end: int, bits: int, size: int, version: int, depth: int
    ) -> tuple[_Type, int | None]:
        lay = self.lay
        n = bits & 0xFFFF
        width = 1 if size < 1 << 8 else 2 if size < 1 << 16 else 3 if size < 1 << 24 else 4
        blob = lay.bytes_at(q, end - q)
        kinds = []
        pos: int | None = q
        for _ in range(n):
            if pos is None:
                return _Type("skip", size, why="a compound with a member this reader cannot size"), None
            stop = blob.find(b"\0", pos - q) + q if q <= pos < end else q - 1
            if stop < pos:
                raise lay.bad(f"compound datatype at {p}: a member name runs past its message")
            if version >= 3:
                pos = stop + 1 + width
            else:
                pos += _pad8(stop - pos + 1) + 4 + (28 if version == 1 else 0)
            member, pos = self.dtype(pos, end, depth + 1)
            kinds.append(member)
        bad = [m for m in kinds if m.heap or m.kind == "skip"]
        if bad:
            why = "a compound with " + (bad[0].why or "variable-length members")
            return _Type("skip", size, why=why, heap=any(m.heap for m in bad)), pos
        return _Type("h5py", size), pos

    def committed(self, p: int, end: int, name: str) -> _Type | None:
        """The committed datatype a shared-message field at ``p`` names (None: one in the
        shared-message heap, not read here)."""
        lay = self.lay
        if p + 2 > end:
            raise lay.bad(f"attribute {name}: its shared datatype runs past its message")
        version, kind = lay.uint(p, 1), lay.uint(p + 1, 1)
        if version == 3 and kind == 1:
            return None
        at = p + (8 if version == 1 else 2)
        if version not in (1, 2, 3) or (version == 3 and kind != 2) or at + lay.osz > end:
            raise lay.bad(f"attribute {name}: a shared datatype of version {version}, type {kind}")
        addr = lay.addr(at)
        if not 0 <= addr < lay.size:
            raise lay.bad(f"attribute {name}: its committed datatype at {addr} is outside the file")
        found = lay.header(addr).find(DTYPE)
        if not found or found[0][0] & 0x02:
            raise lay.bad(f"attribute {name}: no datatype in the committed datatype at {addr}")
        _f, q, size = found[0]
        return self.dtype(q, q + size)[0]

    # -- the global heap --------------------------------------------------------------------------
    def collection(self, addr: int) -> Collection:
        """The objects of the global heap collection at ``addr`` (:mod:`.hdf5_heap`)."""
        return heap_collection(self.lay, addr, self.heaps)

    def heap_object(self, ref: bytes, want: int, name: str) -> bytes:
        """The bytes of a heap reference (length, collection address, index) of ``want`` bytes."""
        lay = self.lay
        osz = lay.osz
        raw_addr = int.from_bytes(ref[4 : 4 + osz], "little")
        idx = int.from_bytes(ref[4 + osz : 8 + osz], "little")
        if raw_addr == 0:
            if want:
                raise lay.bad(f"attribute {name}: {want} bytes at heap address 0")
            return b""
        got = self.collection(raw_addr + lay.base).get(idx)
        if got is None:
            raise lay.bad(f"attribute {name}: no object {idx} in the global heap at {raw_addr}")
        pos, size = got
        if size != want:
            raise lay.bad(f"attribute {name}: heap object {idx} holds {size} bytes, the value needs {want}")
        return lay.bytes_at(pos, size)

    # -- values -----------------------------------------------------------------------------------
    def dataspace(self, p: int, end: int) -> tuple[int, ...] | None:
        lay = self.lay
        if p + 4 > end:
            raise lay.bad(f"dataspace at {p} runs past its attribute")
        b = lay.bytes_at(p, 4)
        if b[0] not in (1, 2) or b[1] > 32:
            raise lay.bad(f"dataspace at {p}: version {b[0]}, rank {b[1]}")
        if b[0] == 2 and b[3] == 2:
            return None
        if b[0] == 2 and b[3] not in (0, 1):
            raise lay.bad(f"dataspace at {p}: type {b[3]}")
        d0 = p + (8 if b[0] == 1 else 4)
        if d0 + b[1] * lay.lsz > end:
            raise lay.bad(f"dataspace at {p}: {b[1]} dims past its attribute")
        dims = tuple(lay.uint(d0 + i * lay.lsz, lay.lsz) for i in range(b[1]))
        if any(d < 0 for d in dims):
            raise lay.bad(f"dataspace at {p}: an undefined dimension")
        return dims

    def value(self, t: _Type, shape: tuple[int, ...], data: bytes, name: str) -> Any:
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if t.kind == "num":
            arr = np.frombuffer(data, t.dtype, count).reshape(shape)
            return arr.item() if not shape else arr.tolist()
        if t.kind == "bool":
            raw = np.frombuffer(data, t.dtype, count)
            if ((raw != 0) & (raw != 1)).any():
                return _H5PY
            arr = raw.astype(bool).reshape(shape)
            return arr.item() if not shape else arr.tolist()
        if t.kind == "str":
            out = [_fixed_string(data[i * t.size : (i + 1) * t.size], t.pad) for i in range(count)]
            return out[0] if not shape else out
        width = t.size
        items = []
        for i in range(count):
            ref = data[i * width : (i + 1) * width]
            n = int.from_bytes(ref[:4], "little")
            if t.kind == "vstr":
                text = self.heap_object(ref, n, name)
                items.append(text.split(b"\0", 1)[0].decode("utf-8", "surrogateescape"))
            else:
                base = t.base
                if n > len(self.lay.buf) // max(base.size, 1):
                    raise self.lay.bad(f"attribute {name}: a sequence of {n} elements")
                seq = self.heap_object(ref, n * base.size, name)
                items.append(np.frombuffer(seq, base.dtype).tolist())
        return items[0] if not shape else items

    def attribute(self, p: int, size: int, mflags: int, path: str) -> tuple[str, Any]:
        """``(name, value)`` of the attribute message at ``p`` (value :data:`_H5PY` or a
        :class:`_Skip`)."""
        lay = self.lay
        end = p + size
        if size < 8:
            raise lay.bad(f"{path}: attribute message at {p} of {size} bytes")
        b = lay.bytes_at(p, 9 if size >= 9 else 8)
        version, flags = b[0], b[1]
        nsize, tsize, ssize = (int.from_bytes(b[i : i + 2], "little") for i in (2, 4, 6))
        if version not in (1, 2, 3) or nsize == 0:
            raise lay.bad(f"{path}: attribute message at {p}: version {version}, a name of {nsize} bytes")
        pos = p + (9 if version == 3 else 8)
        fit = _pad8 if version == 1 else int
        if pos + fit(nsize) + fit(tsize) + fit(ssize) > end:
            raise lay.bad(f"{path}: attribute at {p}: its name, type and space run past the message")
        name = lay.bytes_at(pos, nsize).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        tpos = pos + fit(nsize)
        spos = tpos + fit(tsize)
        dpos = spos + fit(ssize)
        if mflags & 0x02 or (version >= 2 and flags & 0x02):
            return name, _Skip("the attribute or its dataspace is a shared message")
        label = f"{name[:60]!r} of {path[:80]!r}"
        if version >= 2 and flags & 0x01:
            t = self.committed(tpos, tpos + tsize, label)
            if t is None:
                return name, _Skip("its datatype is in the shared-message heap")
        else:
            t, _nxt = self.dtype(tpos, tpos + tsize)
        shape = self.dataspace(spos, spos + ssize)
        if shape is None:
            return name, _H5PY  # a null dataspace: h5py.Empty, no data
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if count * t.size > end - dpos:
            raise lay.bad(
                f"{path}: attribute {name[:60]!r}: {count} values of {t.size} bytes past its message"
            )
        if t.kind == "h5py":
            return name, _H5PY
        if t.kind == "skip":
            return name, _Skip(t.why)
        return name, self.value(t, shape, lay.bytes_at(dpos, count * t.size), label)


class _Skip(NamedTuple):
    why: str


_H5PY = object()


def _fixed_string(raw: bytes, pad: int) -> str:
    """A fixed-length string as h5py reads it (into a null-padded numpy ``S`` type), decoded."""
    if pad == 0:  # null-terminated: libhdf5 converts up to the first NUL
        raw = raw.split(b"\0", 1)[0]
    elif pad == 2:  # space-padded: trailing spaces dropped
        raw = raw.rstrip(b" ")
    return raw.rstrip(b"\0").decode("utf-8", errors="replace")


def read_attributes(lay: Layout, h: Header, path: str, heaps: dict[int, Any]) -> Attrs:
    """The attributes of the object whose header is ``h`` (``path`` names it in errors;
    ``heaps`` caches the global heap collections of the file between calls).

    Raises :class:`~tdz_numba.BadArchiveError` for a damaged attribute message, datatype,
    dataspace or global heap collection.
    """
    dense = False
    for _f, p, size in h.find(AINFO):
        flags = lay.uint(p + 1, 1) if size >= 2 else 0
        at = p + 2 + (2 if flags & 1 else 0)
        if at + lay.osz > p + size:
            raise lay.bad(f"{path}: attribute info message at {p} of {size} bytes")
        dense = dense or lay.addr(at) != -1
    if dense:
        return Attrs({}, [], {}, True, [])
    reader = _Reader(lay, heaps)
    found: list[tuple[str, Any]] = []
    order: list[int] = []
    tracked = _tracked(lay, h)
    for _t, mflags, p, size in h.rows.tolist():
        if _t == ATTR:
            found.append(reader.attribute(p, size, mflags, path))
            order.append(lay.uint(p - 2, 2) if tracked else 0)  # the message's creation index
    if tracked:
        found = [x for _o, _i, x in sorted(zip(order, range(len(found)), found))]
    else:
        found.sort(key=lambda x: x[0].encode("utf-8", "surrogateescape"))
    values: dict[str, Any] = {}
    later: list[str] = []
    skipped: dict[str, str] = {}
    for name, value in found:
        if value is _H5PY:
            later.append(name)
        elif isinstance(value, _Skip):
            skipped[name] = value.why
        else:
            values[name] = value
    return Attrs(values, later, skipped, False, [n for n, _v in found])


def _tracked(lay: Layout, h: Header) -> bool:
    """Whether the object tracks its attributes' creation order (h5py lists them in that order)."""
    head = lay.bytes_at(h.addr, 6) if h.addr + 6 <= lay.size else b""
    return head[:4] == b"OHDR" and bool(head[5] & 0x04)
