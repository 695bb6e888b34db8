"""The h5py side of the HDF5 reader: datasets and attributes read through libhdf5.

:func:`~tdz_numba.formats.hdf5.open_hdf5` reads the file's structure itself
(:mod:`~tdz_numba.formats.hdf5_objects`) and hands h5py only the objects it
has checked: datasets it does not map itself (chunked, filtered, compact,
unallocated, big-endian, strings, compound, scalars), attributes, and, with
``allow_external=True``, virtual datasets, external storage and the objects
behind external links (each named file checked by
:mod:`tdz_numba.files.confine` first).
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadArchiveError, TdzError, UnsupportedError
from ..files.confine import MAX_SYMLINKS, open_inside
from ..tdz.sources import MAX_DEPTH, MappedFile, TensorSpec, check_extent

__all__ = [
    "plain",
    "attrs_of",
    "Group",
    "Ctx",
    "dataset",
    "described",
    "refused",
    "check_inside",
    "follow",
    "walk_h5py",
    "h5_string",
    "BufferReader",
]

MAX_OBJECTS = 1_000_000
_ZERO_COPY_KINDS = "biufc"
_LAYOUT_CONTIGUOUS, _LAYOUT_VIRTUAL = 1, 3


class BufferReader(io.RawIOBase):
    """A read-only, seekable file object over bytes already in memory (a remote file fetched
    whole), for ``h5py.File(fileobj)``: libhdf5 reads through :meth:`readinto`, no copy of the
    whole buffer is made.

    Examples
    --------
    >>> r = BufferReader(np.frombuffer(b"abcdef", np.uint8))
    >>> _ = r.seek(2); r.read(3)
    b'cde'
    """

    def __init__(self, buffer: Any) -> None:
        self._buf = memoryview(buffer).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._buf) - self._pos))
        out[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n


def plain(value: Any) -> Any:
    """An attribute or scalar dataset value as plain Python (arrays become lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O" or value.dtype.kind == "S":
            return [plain(v) for v in value.reshape(-1).tolist()] if value.ndim else plain(value.item())
        return value.tolist() if value.dtype.fields is None else value
    if isinstance(value, np.generic):
        return value.item() if value.dtype.fields is None else value
    return value


def attrs_of(obj: Any, where: str, names: list[str] | None = None) -> dict[str, Any]:
    """The attributes of an h5py object made plain (only ``names`` when given); one h5py cannot
    read is left out."""
    out: dict[str, Any] = {}
    try:
        names = list(obj.attrs.keys()) if names is None else names
    except Exception as e:  # noqa: BLE001 - h5py raises many kinds on corrupt files
        raise BadArchiveError(f"{where}: cannot list attributes of {obj.name!r}: {e}") from None
    for name in names:
        try:
            out[name] = plain(obj.attrs[name])
        except Exception:  # noqa: BLE001 - an attribute of a type h5py cannot read: left out
            continue
    return out


class Group(dict):
    """A level of the tree with the group's attributes (and, when the walk made its values in
    one pass, their :class:`~tdz_numba.tdz.specbulk.SpecColumns`: ``flat_source`` hands them on)."""

    meta: dict[str, Any]
    columns: Any = None


def _loader(dset: Any, native: np.dtype, where: str):
    def load() -> np.ndarray:
        try:
            value = dset[()]
        except TdzError:
            raise
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot read dataset {dset.name!r}: {e}") from None
        return np.ascontiguousarray(np.asarray(value).astype(native, copy=False))

    return load


def refused(name: str, why: str):
    def load() -> None:
        raise UnsupportedError(f"dataset {name!r}: {why}")

    return load


class Ctx:
    """What the walk of one file needs: the input's folder and whether other files may be read."""

    def __init__(self, h5: Any, folder: Path, where: str, allow_external: bool) -> None:
        self.h5 = h5
        self.folder = folder
        self.where = where
        self.allow_external = allow_external


def check_inside(ctx: Ctx, name: str, entry: str) -> None:
    """Raises unless ``name`` is a regular file inside the input's folder (``"."``: the file itself)."""
    if name == ".":
        return
    os.close(open_inside(ctx.folder, name, where=ctx.where, entry=entry))


def _names_other_files(plist: Any) -> tuple[str, list[str]] | None:
    """``(why, file names)`` when the dataset's data live in other files (virtual or external storage)."""
    if plist.get_layout() == _LAYOUT_VIRTUAL:
        names = [plist.get_virtual_filename(i) for i in range(min(plist.get_virtual_count(), MAX_OBJECTS))]
        return "a virtual dataset (its data live in other files)", names
    n = plist.get_external_count()
    if n > 0:
        names = [plist.get_external(i)[0] for i in range(min(n, MAX_OBJECTS))]
        return "external raw storage (its data live in other files)", [
            x.decode("utf-8", "surrogateescape") if isinstance(x, bytes) else str(x) for x in names
        ]
    return None


def _external_loader(ctx: Ctx, dset: Any, plist: Any, native: np.dtype, nbytes: int, where: str):
    """Reads external raw storage segments itself, each file through the confine rule."""
    segments = [plist.get_external(i) for i in range(plist.get_external_count())]
    name_of = dset.name

    def load() -> np.ndarray:
        out = bytearray(nbytes)
        pos = 0
        for raw, offset, size in segments:
            if pos >= nbytes:
                break
            name = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else str(raw)
            fd = open_inside(ctx.folder, name, where=where, entry=f"dataset {name_of!r}")
            try:
                fsize = os.fstat(fd).st_size
                want = min(int(size), nbytes - pos)
                if offset < 0 or offset + want > fsize:
                    raise BadArchiveError(
                        f"{where}: dataset {name_of!r}: external file {name!r} holds {fsize} bytes, "
                        f"the dataset reads {want} at offset {offset}"
                    )
                got = os.preadv(fd, [memoryview(out)[pos : pos + want]], offset) if want else 0
                if got != want:
                    raise BadArchiveError(
                        f"{where}: dataset {name_of!r}: short read of external file {name!r}"
                    )
            finally:
                os.close(fd)
            pos += want
        if pos < nbytes:
            raise BadArchiveError(
                f"{where}: dataset {name_of!r}: external storage holds {pos} bytes, the dataset needs {nbytes}"
            )
        arr = np.frombuffer(bytes(out), dtype=dset.dtype).reshape(dset.shape)
        return np.ascontiguousarray(arr.astype(native, copy=False))

    return load


def _reopened(ctx: Ctx, dset: Any) -> Any:
    """``dset`` opened again with virtual sources looked up in the input's folder."""
    import h5py  # type: ignore[import-untyped]

    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_virtual_prefix(os.fsencode(os.path.abspath(ctx.folder)) + b"/")
    return h5py.Dataset(h5py.h5d.open(dset.file.id, dset.name.encode(), dapl=dapl))


def dataset(dset: Any, key: str, f: MappedFile, where: str, ctx: Ctx, foreign: bool = False) -> Any:
    import torch

    from ..tdz.dtypes import from_numpy_dtype

    dtype = dset.dtype
    shape = tuple(int(d) for d in dset.shape) if dset.shape is not None else None
    if shape is None:  # an HDF5 null dataspace
        return None
    plist = dset.id.get_create_plist()
    native = dtype.newbyteorder("=") if dtype.kind in _ZERO_COPY_KINDS else dtype
    tdtype = from_numpy_dtype(native) if dtype.kind in _ZERO_COPY_KINDS else None
    other = _names_other_files(plist)  # checked before any dtype branch reads a byte
    if other is not None:
        why, names = other
        virtual = plist.get_layout() == _LAYOUT_VIRTUAL
        if ctx.allow_external:
            for name in names:
                check_inside(ctx, name, f"dataset {dset.name!r}")
        if not ctx.allow_external or (not virtual and tdtype is None):
            if ctx.allow_external:
                reason = f"{why}, of type {dtype}: only numeric external storage is read"
            else:
                reason = f"{why}: open with allow_external=True to read files inside {str(ctx.folder)!r}"
            return TensorSpec(
                key,
                tdtype or torch.uint8,
                shape,
                None,
                0,
                0,
                0,
                dtype.str,
                loader=refused(dset.name, reason),
            )
        if not virtual:
            nbytes = math.prod(shape) * dtype.itemsize
            return TensorSpec(
                key,
                tdtype,
                shape,
                None,
                0,
                0,
                0,
                dtype.str,
                loader=_external_loader(ctx, dset, plist, native, nbytes, where),
            )
        dset = _reopened(ctx, dset)
        foreign = True
    if dtype.kind in "SUO" or h5_string(dtype):
        try:
            value = dset.asstr()[()] if h5_string(dtype) else dset[()]
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot read dataset {dset.name!r}: {e}") from None
        return plain(value)
    if shape == ():
        try:
            return plain(dset[()])
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot read dataset {dset.name!r}: {e}") from None
    if tdtype is None:  # compound, opaque, references...: a numpy value
        try:
            return dset[()]
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot read dataset {dset.name!r}: {e}") from None
    layout = plist.get_layout()
    offset = dset.id.get_offset() if layout == _LAYOUT_CONTIGUOUS and not foreign else None
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    # an unallocated dataset in a file with a userblock: h5py's get_offset() is the undefined
    # address plus the base (userblock - 1), not None; its storage size says it has no bytes
    if offset is not None and dset.id.get_storage_size() < nbytes:
        offset = None
    if offset is not None and dtype.isnative and plist.get_nfilters() == 0:
        spec = TensorSpec(key, tdtype, shape, None, 0, int(offset), nbytes, dtype.str)
        check_extent(spec, f.size, where)
        return spec
    codec, stored = _storage(dset, plist)
    size = math.prod(shape) * dtype.itemsize
    return TensorSpec(
        key, tdtype, shape, None, 0, 0, stored, dtype.str, codec, size, loader=_loader(dset, native, where)
    )


#: HDF5 filter ids and the names shown for them.
_FILTERS = {
    1: "gzip",
    2: "shuffle",
    3: "fletcher32",
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    32001: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    32015: "zstd",
}
_LAYOUTS = {0: "compact", 1: "contiguous", 2: "chunked", 3: "virtual"}


def _storage(dset: Any, plist: Any) -> tuple[str, int]:
    """How a dataset read through h5py is stored: a codec name for ``info``/``tree``
    (``"chunked+shuffle+gzip"``, ``"compact"``, ``"unallocated"``; ``"stored"`` for a plain
    contiguous one) and the bytes it occupies in the file."""
    try:
        stored = int(dset.id.get_storage_size())
        layout = plist.get_layout()
        names = []
        for i in range(min(plist.get_nfilters(), 32)):
            code, _flags, _values, name = plist.get_filter(i)
            names.append(_FILTERS.get(code) or name.decode("ascii", "replace")[:20] or f"filter {code}")
    except Exception:  # noqa: BLE001 - a description only: h5py reads the data or fails there
        return "stored", 0
    if dset.size == 0:
        return "stored", 0
    if stored == 0 and layout != 0:
        return "unallocated", 0
    if layout == 1 and not names:
        return "stored", stored
    return "+".join([_LAYOUTS.get(layout, f"layout {layout}"), *names]), stored


def _soft_through_external(ctx: Ctx, group: Any, path: str) -> Any:
    """The first external link a soft link's ``path`` runs through (``None`` when none),
    resolved component by component from ``group`` (or the root for an absolute path)."""
    import h5py  # type: ignore[import-untyped]

    todo = [c for c in path.split("/") if c not in ("", ".")]
    todo.reverse()
    cur = ctx.h5 if path.startswith("/") else group
    hops = 0
    while todo:
        name = todo.pop()
        if name == "..":
            cur = cur.parent
            continue
        if not isinstance(cur, h5py.Group):
            return None
        link = cur.get(name, getlink=True)
        if link is None:
            return None
        if isinstance(link, h5py.ExternalLink):
            return link
        if isinstance(link, h5py.SoftLink):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise BadArchiveError(f"{ctx.where}: soft link {path!r}: more than {MAX_SYMLINKS} hops")
            inner = [c for c in link.path.split("/") if c not in ("", ".")]
            if link.path.startswith("/"):
                cur = ctx.h5
            todo.extend(reversed(inner))
            continue
        cur = cur.get(name)
    return None


def follow(ctx: Ctx, group: Any, name: str, link: Any) -> bool:
    """Whether the link ``name`` of ``group`` may be followed (no file outside the rule)."""
    import h5py  # type: ignore[import-untyped]

    ext = link if isinstance(link, h5py.ExternalLink) else None
    if isinstance(link, h5py.SoftLink):
        ext = _soft_through_external(ctx, group, link.path)
    if ext is None:
        return True
    if not ctx.allow_external:
        return False  # another file: not followed
    check_inside(ctx, ext.filename, f"external link {group.name.rstrip('/')}/{name}")
    return True


def h5_string(dtype: np.dtype) -> bool:
    import h5py  # type: ignore[import-untyped]

    return h5py.check_string_dtype(dtype) is not None


def walk_h5py(ctx: Ctx, top: Any, node: Group, depth: int, prefix: str, attrs: dict, f: MappedFile) -> None:
    """Walks a group reached through an external link (``allow_external=True``) with h5py,
    as the reader did before it read the structure itself: the objects of another file."""
    import h5py  # type: ignore[import-untyped]

    where = ctx.where
    visited = {top.id}
    stack: list[tuple[Any, Group, int, str]] = [(top, node, depth, prefix)]
    count = 0
    while stack:
        group, node, depth, prefix = stack.pop()
        if depth > MAX_DEPTH:
            raise BadArchiveError(f"{where}: groups nested deeper than {MAX_DEPTH}")
        try:
            names = list(group.keys())
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot list group {group.name!r}: {e}") from None
        for name in names:
            count += 1
            if count > MAX_OBJECTS:
                raise BadArchiveError(f"{where}: more than {MAX_OBJECTS} objects")
            try:
                link = group.get(name, getlink=True)
                if not follow(ctx, group, name, link):
                    continue  # another file: not followed
                obj = group.get(name)
            except TdzError:
                raise
            except Exception as e:  # noqa: BLE001
                raise BadArchiveError(f"{where}: cannot open {group.name}/{name}: {e}") from None
            if obj is None:  # a dangling soft link
                continue
            if isinstance(obj, h5py.Group):
                if obj.id in visited:
                    continue  # a link back to a group already walked
                visited.add(obj.id)
                sub = Group()
                sub.meta = attrs_of(obj, where)
                if sub.meta:
                    attrs[prefix + name] = sub.meta
                node[name] = sub
                stack.append((obj, sub, depth + 1, f"{prefix}{name}/"))
            elif isinstance(obj, h5py.Dataset):
                node[name] = described(ctx, obj, name, f, prefix + name, attrs, foreign=True)


def described(
    ctx: Ctx, obj: Any, key: str, f: MappedFile, tree_path: str, attrs: dict | None, foreign: bool
) -> Any:
    """``dataset()`` of an h5py dataset, and its attributes into ``attrs[tree_path]`` (``attrs``
    None: read elsewhere)."""
    where = ctx.where
    try:
        out = dataset(obj, key, f, where, ctx, foreign)
        if attrs is None:
            return out
        try:
            own = attrs_of(obj, where)
        except BadArchiveError:  # a description only: the data read or fail on their own
            own = {}
        if own:
            attrs[tree_path] = own
        return out
    except TdzError:
        raise
    except Exception as e:  # noqa: BLE001
        raise BadArchiveError(f"{where}: cannot describe dataset {obj.name!r}: {e}") from None
