"""``torch.save`` files (the zip format, and the legacy one of torch < 1.6) as zero-copy sources,
read without unpickling.

The pickle (``<archive>/data.pkl``; in a legacy file, the fourth of the pickles
that precede the storages) runs in :mod:`.pickle_vm`, which interprets
opcodes and recognizes only tensor and storage reconstruction, containers and
scalars; it imports and calls nothing from the file. Each tensor becomes a
:class:`~tdz_numba.tdz.sources.TensorSpec` over its storage record
(``<archive>/data/<key>``, STORED and 64-byte aligned by torch): storage
offsets and strides are kept, so transposes and offset slices come back as
correct strided views, and tensors that share a storage are views of the same
bytes. Every view is checked to stay inside its storage record.

A tensor saved with its conjugate or negative bit set (``x.conj()`` of a
complex tensor, ``torch._neg_view``) stores the unresolved values; its leaf is
read as a copy with the bits applied (``conj_physical``, ``neg``), so it holds
the values ``torch.load`` gives. Views whose strides overlap (``expand``,
stride 0) materialize more bytes than they span: at most
:data:`MAX_EXPANSION` bytes more in all, per file, or the file is refused
(``convert`` would have to write them out).

Refused, with what to do: TorchScript archives, legacy files of the tar era,
big-endian files, compressed storage records, sparse / quantized / nested
tensors and tensor subclasses, sets of tensors, dict keys that are not str,
int, float, bool, None or a dtype, keys that are not valid Unicode (a lone
surrogate: no file name can hold it), two keys of a level that read as the
same string.

Dicts become levels (non-str keys as ``str(key)``), lists and tuples that hold
tensors become levels keyed ``"0"``, ``"1"``, ...; other values (ints, floats,
strings, None, bools, ``torch.Size``, ``torch.device``, dtypes, and containers
of them) are plain values. A top-level tensor is the single key ``"0"``.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from tdz_numba.formats import torch_pt, to_tree
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "ckpt.pt"
...     a = torch.arange(6.0).reshape(2, 3)
...     torch.save({"a": a, "at": a.t(), "step": 3}, p)
...     tree = to_tree(torch_pt.open_torch(p))
...     print(tree["at"].tolist(), tree["step"])
[[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]] 3
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from itertools import repeat
from operator import eq
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import BadArchiveError, UnsupportedError
from ..jit.policy import mode, use_kernels
from ..tdz.dtypes import dtype_table
from ..tdz.sources import (
    MAX_DEPTH,
    MappedFile,
    TensorSpec,
    TreeSource,
    check_extent,
    span_bytes,
    tensor_from_spec,
)
from ..tdz.specbulk import SpecColumns
from ..tdz.tree import Level
from ..zipfmt.index import ArchiveIndex
from ..zipfmt.records import STORED
from . import pickle_vm
from ._common import no_gc
from ._flat import flat_source
from ._shape import MAX_NDIM, check_shape
from .detect import torch_pickles, zip_kind

__all__ = ["open_torch", "open_torch_legacy", "MAX_EXPANSION"]

#: Most bytes the views of one file with overlapping strides may add when materialized
#: (element count x size minus the bytes they span).
MAX_EXPANSION = 1 << 30


class _Record:
    """A storage's bytes in the file: ``offset`` and ``nbytes`` (a legacy file's are set once
    the pickles that come before the data have been read)."""

    __slots__ = ("key", "offset", "nbytes", "numel", "dtype", "root", "start")

    def __init__(self, key: str, offset: int, nbytes: int, numel: int = 0, dtype: Any = None) -> None:
        self.key, self.offset, self.nbytes, self.numel, self.dtype = key, offset, nbytes, numel, dtype
        self.root: _Record | None = None  # a legacy storage view: its root and first element
        self.start = 0


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_I64 = struct.Struct("<q")


def open_torch_legacy(path: str | os.PathLike, **options: Any) -> TreeSource:
    """A legacy (torch < 1.6, non-zip) ``torch.save`` file as a :class:`~tdz_numba.sources.TreeSource`.

    The file is five pickles in a row (magic number, protocol version, system
    info, the object, the storage keys), then each storage's element count and
    bytes, in the keys' order: the storages are mapped where they lie, as in
    the zip format. ``options`` are ignored.

    Raises
    ------
    UnsafeContentError, UnsupportedError, BadArchiveError
        As :func:`open_torch`; also big-endian files and old module pickles.
    """
    where = str(path)
    f = MappedFile.open(path)
    try:
        tree = _open_legacy(f, where)
    except BaseException:
        f.close()
        raise
    return TreeSource("torch", Path(path), tree, files=[f], metadata={})


def _open_legacy(f: MappedFile, where: str) -> Level:
    data = bytes(f.buffer[: min(f.size, pickle_vm.MAX_PICKLE_BYTES)])
    nop = lambda pid: None  # noqa: E731 - the header pickles hold no storage
    magic, pos = pickle_vm.load_at(data, nop, f"{where}: magic number pickle", 0)
    if magic != _LEGACY_MAGIC:
        raise BadArchiveError(f"{where}: legacy torch file with magic number {pickle_vm.short(magic)}")
    version, pos = pickle_vm.load_at(data, nop, f"{where}: protocol version pickle", pos)
    if version != _LEGACY_PROTOCOL:
        raise BadArchiveError(f"{where}: legacy protocol version {pickle_vm.short(version)}, expected 1001")
    info, pos = pickle_vm.load_at(data, nop, f"{where}: system info pickle", pos)
    if not isinstance(info, dict) or info.get("little_endian", True) is not True:
        raise UnsupportedError(f"{where}: saved on a big-endian machine (or no system info); not read")
    roots: dict[str, _Record] = {}
    views: list[_Record] = []

    def persistent_load(pid: tuple) -> _Record:
        if pid and pid[0] == "module":
            raise UnsupportedError(f"{where}: the file pickles a whole module (an old torch.save of a model)")
        if len(pid) != 6 or pid[0] != "storage":
            raise BadArchiveError(
                f"{where}: persistent id of {len(pid)} fields, expected "
                f"('storage', type, key, location, numel, view)"
            )
        _, stype, key, location, numel, view = pid
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise BadArchiveError(f"{where}: malformed storage id (key, location, numel)")
        rec = roots.get(key)
        if rec is None:
            rec = roots[key] = _Record(key, -1, numel * stype.dtype.itemsize, numel, stype.dtype)
        if view is None:
            return rec
        ok = isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
        if not ok or not all(type(x) is int and x >= 0 for x in view[1:]):
            raise BadArchiveError(f"{where}: malformed storage view {pickle_vm.short(view)}")
        v = _Record(view[0], -1, view[2] * rec.dtype.itemsize)
        v.root, v.start = rec, view[1] * rec.dtype.itemsize
        views.append(v)
        return v

    root, pos = pickle_vm.load_at(data, persistent_load, f"{where}: object pickle", pos)
    keys, pos = pickle_vm.load_at(data, nop, f"{where}: storage keys pickle", pos)
    if (
        not isinstance(keys, list)
        or len(keys) != len(roots)
        or not all(type(k) is str and k in roots for k in keys)
    ):
        raise BadArchiveError(f"{where}: the storage keys pickle does not list the storages the object uses")
    for key in keys:  # each: int64 element count, then the bytes
        rec = roots[key]
        if pos + 8 > f.size:
            raise BadArchiveError(f"{where}: storage {key!r} starts past the end of the file")
        (count,) = _I64.unpack_from(f.buffer[pos : pos + 8].tobytes())
        if count != rec.numel or pos + 8 + rec.nbytes > f.size:
            raise BadArchiveError(
                f"{where}: storage {key!r}: {count} elements at byte {pos}, the pickle says "
                f"{rec.numel} ({rec.nbytes} bytes; the file has {f.size})"
            )
        rec.offset = pos + 8
        pos += 8 + rec.nbytes
    for v in views:
        r = v.root
        assert r is not None
        if v.start + v.nbytes > r.nbytes:
            raise BadArchiveError(f"{where}: storage view {v.key!r} runs past its storage {r.key!r}")
        v.offset = r.offset + v.start
    return _to_tree(root, where, f.size, [f])


def _prefix(index: ArchiveIndex, where: str) -> str:
    kind = zip_kind(index.names, where)  # TorchScript archives are refused here
    if kind != "torch":
        raise UnsupportedError(f"{where}: not a torch.save archive (a {kind} zip)")
    pkls = torch_pickles(index.names)  # (C-level finds in the joined names: 20,000+ members)
    if len(pkls) != 1:
        raise BadArchiveError(f"{where}: expected one <archive>/data.pkl entry, found {pkls[:4]}")
    return pkls[0][: -len("data.pkl")]


def open_torch(path: str | os.PathLike, *, index: ArchiveIndex | None = None, **options: Any) -> TreeSource:
    """A ``torch.save`` zip as a :class:`~tdz_numba.tdz.sources.TreeSource`.

    ``allow_pickle`` (and other options) are ignored: the pickle is always read
    by the restricted VM.

    Raises
    ------
    UnsafeContentError
        The pickle names a global that is not tensor reconstruction.
    UnsupportedError
        TorchScript archives, big-endian files, compressed storage records,
        sparse/quantized/nested tensors.
    BadArchiveError
        Malformed zips or pickles, views outside their storage.
    """
    idx = ArchiveIndex(path) if index is None else index
    try:
        return _open(Path(path), idx)
    finally:
        idx.close()


def _open(path: Path, index: ArchiveIndex) -> TreeSource:
    where = str(path)
    prefix = _prefix(index, where)
    order = prefix + "byteorder"
    if order in index:
        value = index.read_bytes(order)
        if value == b"big":
            raise UnsupportedError(f"{where}: saved on a big-endian machine (byteorder 'big'); not read")
        if value != b"little":
            raise BadArchiveError(f"{where}: byteorder record holds {value[:16]!r}, expected 'little'")
    data = index.read_bytes(prefix + "data.pkl")
    records: dict[str, _Record] = {}
    size = index.size
    index.check_all()  # every local header in one pass (the kernel or its twin): payload offsets filled
    columns: list[list[int]] = []  # the index's columns as lists: made when the VM runs

    def persistent_load(pid: tuple) -> _Record:
        if len(pid) != 5 or pid[0] != "storage":
            raise BadArchiveError(
                f"{where}: persistent id of {len(pid)} fields, expected ('storage', type, key, location, numel)"
            )
        _, stype, key, location, numel = pid
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise BadArchiveError(f"{where}: malformed storage id (key, location, numel)")
        rec = records.get(key)
        if rec is None:
            if not columns:
                t = index.table
                columns.extend(t[c].tolist() for c in ("method", "size", "csize", "payload_offset"))
            methods, sizes, csizes, payloads = columns
            name = prefix + "data/" + key
            i = index.row(name)
            if "/" in key or i is None:
                raise BadArchiveError(f"{where}: storage {key!r} has no record {name!r}")
            if methods[i] != STORED:
                raise UnsupportedError(
                    f"{where}: storage record {name!r} is compressed; torch.save writes them stored"
                )
            if sizes[i] != csizes[i]:
                raise BadArchiveError(f"{where}: stored record {name!r} has sizes {csizes[i]} and {sizes[i]}")
            rec = records[key] = _Record(key, payloads[i], sizes[i])
            rec.dtype = stype.dtype
        if numel * stype.dtype.itemsize > rec.nbytes:
            raise BadArchiveError(
                f"{where}: storage {key!r} claims {numel} {stype.name} elements, "
                f"its record holds {rec.nbytes} bytes"
            )
        return rec

    scanned = None
    if use_kernels(len(data) // 100) and (len(data) >= _SCAN_FROM or mode() == "always"):
        from . import pickle_scan  # imports Numba

        with no_gc():  # 20,000+ names and shape tuples
            scanned = pickle_scan.scan(data, unique=False)  # (_bulk_tree tells repeated names)
    root = None
    if scanned is None:
        root = pickle_vm.load(data, persistent_load, f"{where}: {prefix}data.pkl")
    f = MappedFile.of_index(path, index)  # (the mapping the header check read: faults shared)
    try:
        if f.size != size:
            raise BadArchiveError(f"{where}: the file changed while it was opened")
        with no_gc():  # 20,000+ specs and levels: no collector passes over them
            tree = None
            if scanned is not None:
                tree = _bulk_tree(scanned, index, prefix, _Ctx(where, size, [f], {}, [0]))
            if tree is None:
                if root is None:  # the scan's columns break a rule: the VM says which
                    root = pickle_vm.load(data, persistent_load, f"{where}: {prefix}data.pkl")
                tree = _to_tree(root, where, size, [f])
    except BaseException:
        f.close()
        raise
    return flat_source("torch", path, tree, files=[f], metadata={}, meta=tree.meta)


#: Pickles shorter than this (one or two tensors) go to the VM unless the kernels are forced: a
#: tensor costs it ~14 us, the scan and bulk checks ~40 us however few (one-tensor load -7%).
_SCAN_FROM = 300


def _bulk_tree(s: Any, index: ArchiveIndex, prefix: str, ctx: _Ctx) -> Level | None:
    """The root level of a flat dict of tensors from the pickle scan's columns
    (:class:`~tdz_numba.formats.pickle_scan.Scanned`): what the VM's
    ``persistent_load``, ``_rebuild_tensor_v2`` and :func:`_to_tree` make of them, checked in
    bulk; None when a rule of those breaks (the VM then reads the pickle and raises)."""
    n = len(s.names)
    first = s.storage_types[0]
    one_type = s.storage_types.count(first) == n  # (one object for all: identity, no hashing)
    stypes: dict[tuple[str, str], pickle_vm.StorageType] = {}
    for t in (first,) if one_type else set(s.storage_types):
        v = pickle_vm.GLOBALS.get(t)
        if type(v) is not pickle_vm.StorageType:
            return None
        stypes[t] = v
    table = index.table
    rows = _record_rows(s, index, prefix)
    if rows is None:
        return None
    if (table["method"][rows] != STORED).any() or (table["size"][rows] != table["csize"][rows]).any():
        return None
    rec_bytes = table["size"][rows]
    rec_offset = table["payload_offset"][rows]
    if one_type:
        dtype = stypes[first].dtype
        dtypes = [dtype] * n
        isz = np.full(n, dtype.itemsize, np.int64)
        names = [_TYPE_NAMES[dtype]] * n
    else:
        dtype_of = {t: v.dtype for t, v in stypes.items()}
        dtypes = list(map(dtype_of.__getitem__, s.storage_types))
        sizes = {d: d.itemsize for d in set(dtypes)}
        isz = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, len(dtypes))
        names = list(map(_TYPE_NAMES.__getitem__, dtypes))
    numel, offset = s.numels, s.offsets
    if (numel < 0).any() or (offset < 0).any() or (numel > rec_bytes // isz).any():
        return None  # persistent_load's and the rebuild's checks: the VM raises
    # _view's common case, in bulk: C-contiguous, non-empty, inside the record
    shape0 = s.shapes[0]
    one_shape = s.shapes.count(shape0) == n  # (one tuple for all: identity)
    dense: dict[tuple[int, ...], tuple[tuple[int, ...] | None, int]] = {}
    for shape in (shape0,) if one_shape else set(s.shapes):
        dense[shape] = (_c_strides(shape) if len(shape) <= MAX_NDIM else None, math.prod(shape))
    if len(dense) == 1:  # one shape (a model's many equal layers): its C strides and size for all
        ((c_one, k_one),) = dense.values()
        if (c_one == s.strides[0] and s.strides.count(s.strides[0]) == n) or s.strides.count(c_one) == n:
            fast = np.ones(n, bool)
        else:
            fast = np.fromiter(map(eq, repeat(c_one), s.strides), bool, n)
        count = np.full(n, k_one, np.int64)
    else:
        c_strides, counts = zip(*map(dense.__getitem__, s.shapes))
        fast = np.fromiter(map(eq, c_strides, s.strides), bool, n)
        count = np.fromiter(counts, np.int64, n)
    whole = rec_bytes // isz  # elements the record holds
    fast &= (offset <= whole) & (count <= whole - np.minimum(offset, whole))
    start = np.where(fast, offset * isz, 0)
    offsets, nbytes = (rec_offset + start).tolist(), (rec_bytes - start).tolist()
    made = list(
        map(
            tuple.__new__,  # (no partial call per row: see formats._flat)
            repeat(TensorSpec, n),
            zip(
                s.names,
                dtypes,
                s.shapes,
                s.strides,
                repeat(0, n),
                offsets,
                nbytes,
                names,
                repeat("stored", n),
                repeat(0, n),
                repeat(None, n),
                repeat(None, n),
            ),
        )
    )
    level = _SpecLevel(zip(s.names, made), meta={"_torch_type": s.root})
    if len(level) != n:  # a name set twice: the VM keeps the last value
        return None
    if fast.all():  # every spec stored, C-contiguous, inside its record: the views check the columns
        level.columns = SpecColumns(made, dtypes, s.shapes, 0, offsets, nbytes)
    else:
        for i in np.flatnonzero(~fast).tolist():
            rec = _Record(s.storage_keys[i], int(rec_offset[i]), int(rec_bytes[i]))
            ref = pickle_vm.TensorRef(rec, int(offset[i]), s.shapes[i], s.strides[i], dtypes[i], False)
            level[s.names[i]] = _view(ref, s.names[i], ctx)
    return level


class _SpecLevel(Level):
    """:func:`_bulk_tree`'s root level, with its specs' columns when all are C-contiguous (as
    :class:`~tdz_numba.formats._flat.SpecDict`: the view path checks extents from them)."""

    columns: SpecColumns | None = None


def _record_rows(s: Any, index: ArchiveIndex, prefix: str) -> np.ndarray | None:
    """Each tensor's storage record row (what ``persistent_load`` looks up by name): found by
    key number in one compiled pass (:func:`.pt_records.rows_by_number`), else by name, once per
    distinct key; None when a key names no record (or holds a ``/``)."""
    from . import pt_records  # (the scan ran: Numba is imported)

    rows = pt_records.rows_by_number(index, prefix, s.key_numbers)
    if rows is not None:
        return rows
    keys = dict.fromkeys(s.storage_keys)
    if "/" in "".join(keys):
        return None
    found = index.rows_of(map((prefix + "data/").__add__, keys))
    if None in found:
        return None
    slot = dict(zip(keys, range(len(keys))))
    which = np.fromiter(map(slot.__getitem__, s.storage_keys), np.int64, len(s.names))
    return np.asarray(found, np.int64)[which]


class _Ctx(NamedTuple):
    """What every leaf of one file needs: the file's size and mapping, caches, the expansion budget."""

    where: str
    size: int
    files: list[MappedFile]
    contiguous: dict
    expanded: list[int]


def _spec(ref: pickle_vm.TensorRef, key: str, ctx: _Ctx) -> TensorSpec:
    spec = _view(ref, key, ctx)
    if ref.conj or ref.neg:  # torch stores the unresolved values: apply the bits, as a copy
        spec = spec._replace(loader=_resolver(spec, ctx.files, ref.conj, ref.neg))
    return spec


def _resolver(spec: TensorSpec, files: list[MappedFile], conj: bool, neg: bool) -> Any:
    def load() -> torch.Tensor:
        t = tensor_from_spec(spec, files)
        if conj:
            t = t.conj_physical()
        return t.neg() if neg else t

    return load


def _view(ref: pickle_vm.TensorRef, key: str, ctx: _Ctx) -> TensorSpec:
    where, size, contiguous = ctx.where, ctx.size, ctx.contiguous
    rec = ref.storage
    if type(rec) is not _Record:
        raise BadArchiveError(f"{where}: tensor {key!r} is not backed by a storage record")
    dtype = ref.dtype
    itemsize = dtype.itemsize
    start = ref.offset * itemsize
    shape, stride = ref.shape, ref.stride
    spec = TensorSpec(
        key, dtype, shape, stride, 0, rec.offset + start, rec.nbytes - start, _TYPE_NAMES[dtype]
    )
    # the common case, checked cheaply: C-contiguous, non-empty, inside its record
    c = contiguous.get(shape, False)
    if c is False:
        c = contiguous[shape] = _c_strides(shape) if len(shape) <= MAX_NDIM else None
    if c == stride and spec.numel * itemsize <= rec.nbytes - start:
        return spec
    if start > rec.nbytes:
        raise BadArchiveError(
            f"{where}: tensor {key!r}: storage offset {ref.offset} is past its storage "
            f"{rec.key!r} ({rec.nbytes} bytes)"
        )
    check_shape(
        shape, stride if all(s >= 0 for s in stride) else None, itemsize, f"{where}: tensor {key!r}"
    )  # negative strides are refused by check_extent
    check_extent(spec, size, f"{where}: storage {rec.key!r}")
    extra = spec.numel * itemsize - span_bytes(shape, stride, itemsize)
    if extra > 0:  # overlapping strides (expand, stride 0): copies are larger than the file
        ctx.expanded[0] += extra
        if ctx.expanded[0] > MAX_EXPANSION:
            raise UnsupportedError(
                f"{where}: tensor {key!r} (shape {list(shape)}, stride {list(stride)}) repeats "
                f"the bytes of its storage; the file's overlapping views would materialize "
                f"{ctx.expanded[0]} bytes more than they span (limit {MAX_EXPANSION})"
            )
    return spec


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """C-contiguous strides of a shape of positive dims (None otherwise: the slow path checks it)."""
    out, acc = [], 1
    for d in reversed(shape):
        if d <= 0:
            return None
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


_TYPE_NAMES = {dt: str(dt)[len("torch.") :] for dt in dtype_table().values()}


_CONTAINERS = (dict, list, tuple)
_INTERNAL = (pickle_vm._Fn, pickle_vm.StorageType, pickle_vm._Storage)


def _what(v: Any) -> str:
    if isinstance(v, (pickle_vm._Fn, pickle_vm.StorageType)):
        return f"the class or function {v.name}"
    return "a set of tensors" if isinstance(v, (set, frozenset)) else "a bare storage"


def _holds_tensor(root: Any, where: str) -> dict[int, bool]:
    """For every container reachable from ``root``: whether a tensor is below it.

    Iterative; raises BadArchiveError on a cycle or nesting deeper than MAX_DEPTH.
    """
    result: dict[int, bool] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        nid = id(node)
        if done:
            on_path.discard(nid)
            values = node.values() if isinstance(node, Mapping) else node
            result[nid] = any(isinstance(v, pickle_vm.TensorRef) or result.get(id(v), False) for v in values)
            continue
        if nid in result:
            continue
        if nid in on_path:
            raise BadArchiveError(f"{where}: the pickle holds a container that contains itself")
        if len(on_path) >= MAX_DEPTH:
            raise BadArchiveError(f"{where}: containers nested deeper than {MAX_DEPTH}")
        on_path.add(nid)
        stack.append((node, True))
        values = node.values() if isinstance(node, Mapping) else node
        for v in values:
            if isinstance(v, _CONTAINERS):
                stack.append((v, False))
            elif isinstance(v, _INTERNAL) or (
                isinstance(v, (set, frozenset))
                and any(isinstance(x, (pickle_vm.TensorRef, *_INTERNAL)) for x in v)
            ):
                raise UnsupportedError(f"{where}: the pickle holds {_what(v)} as a value, not tensor data")
    return result


def _key(k: Any, where: str) -> str:
    if isinstance(k, str):
        try:
            k.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedError(
                f"{where}: dict key {ascii(k[:60])} is not valid Unicode (a lone surrogate); "
                f"no .tdz entry name can hold it"
            ) from None
        return k
    if k is None or isinstance(k, (int, float, bool, torch.dtype)):
        return str(k)
    raise UnsupportedError(f"{where}: a dict key of type {type(k).__name__} ({pickle_vm.short(k)})")


def _to_tree(root: Any, where: str, size: int, files: list[MappedFile] | None = None) -> Level:
    """The level tree of the unpickled object (containers with tensors -> levels)."""
    ctx = _Ctx(where, size, files or [], {}, [0])
    if isinstance(root, pickle_vm.TensorRef):
        return Level({"0": _spec(root, "0", ctx)}, meta={"_torch_type": "Tensor"})
    if isinstance(root, _INTERNAL):
        raise UnsupportedError(f"{where}: the pickle holds {_what(root)}, not tensor data")
    if not isinstance(root, _CONTAINERS):
        return Level({"0": root}, meta={"_torch_type": type(root).__name__})
    holds = _holds_tensor(root, where)
    out = Level(meta={"_torch_type": type(root).__name__})
    stack: list[tuple[Any, Level, str]] = [(root, out, "")]
    while stack:
        node, level, path = stack.pop()
        items = (
            ((_key(k, where), v) for k, v in node.items())
            if isinstance(node, Mapping)
            else ((str(i), v) for i, v in enumerate(node))
        )
        for key, value in items:
            if key in level:
                raise UnsupportedError(f"{where}: two keys of {path or '<root>'} both read as {key!r}")
            if isinstance(value, pickle_vm.TensorRef):
                level[key] = _spec(value, path + key, ctx)
            elif isinstance(value, dict) or (isinstance(value, _CONTAINERS) and holds.get(id(value))):
                level[key] = sub = Level(meta={"_torch_type": type(value).__name__})
                stack.append((value, sub, path + key + "/"))
            else:
                level[key] = value
    return out
