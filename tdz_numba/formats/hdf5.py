"""HDF5 files through h5py (optional): groups as levels, contiguous datasets mapped zero-copy.

The group tree is walked iteratively (depth limited to
:data:`~tdz_numba.tdz.sources.MAX_DEPTH`, each group visited once even when hard
or soft links make cycles). Each dataset becomes a leaf:

- contiguous, unfiltered, allocated datasets of a native numeric dtype: a
  :class:`~tdz_numba.tdz.sources.TensorSpec` at ``dset.id.get_offset()`` in the
  mapped file (zero-copy, bounds checked against the file size);
- chunked, filtered (gzip, ...), compact, not yet allocated, big-endian
  datasets: a spec whose ``loader`` reads it through h5py (a copy); its
  ``codec`` says how it is stored (``"chunked+shuffle+gzip"``, ``"compact"``,
  ``"unallocated"``) and ``nbytes`` the bytes it occupies in the file;
- scalars and strings: plain Python values (``str`` for strings, lists for
  string arrays); compound/opaque datasets: a numpy array read at open.

Attributes (numpy values as Python scalars/lists, bytes decoded): the root
group's are the file's ``metadata``, another group's are its level's
``metadata`` (``ar["g"].metadata``); :meth:`HDF5Source.attributes` gives any
group's or dataset's (``ar.source.attributes("g/w")``).

Other files: virtual datasets, external raw storage and external links name
other files. None of them is read unless the caller opens with
``allow_external=True``: a virtual or external-storage dataset of any type
(numeric, compound, opaque, string, scalar) is a leaf that refuses when read
(:class:`~tdz_numba.UnsupportedError`), checked before any byte of it is read;
an external link, and a soft link whose path runs through one, is left out
of the tree. With ``allow_external=True`` every such file must be a regular
file inside the input's folder, reached without a symlink that leaves it
(:mod:`tdz_numba.files.confine`; otherwise
:class:`~tdz_numba.files.confine.OutsideError` at open): numeric external
storage is then read by this reader itself through that rule (non-numeric
external storage stays refused), virtual datasets and objects behind
external links are read through h5py (copies, never the input's mapping),
with virtual sources looked up in the input's folder. HDF5 opens those
files by name after the check (a file swapped in between is a race this
reader cannot close).

The h5py file stays open for the loaders until :meth:`HDF5Source.close`.
Errors raised by h5py on malformed files become
:class:`~tdz_numba.BadArchiveError`.

Examples
--------
>>> import tempfile, pathlib, numpy as np, h5py
>>> from tdz_numba.formats.hdf5 import open_hdf5
>>> from tdz_numba.tdz.sources import tensor_from_spec
>>> with tempfile.TemporaryDirectory() as d:
...     p = pathlib.Path(d) / "x.h5"
...     with h5py.File(p, "w") as f:
...         f.attrs["note"] = "hi"; _ = f.create_dataset("g/w", data=np.arange(4.0))
...     src = open_hdf5(p)
...     g = src.level(src.level("").children["g"].path)
...     print(src.metadata, tensor_from_spec(g.children["w"].leaf, src.files).tolist())
...     src.close()
{'note': 'hi'} [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadArchiveError, TdzError, UnsupportedError
from ..files.confine import MAX_SYMLINKS, open_inside
from ..tdz.sources import MAX_DEPTH, MappedFile, TensorSpec, TreeSource, check_extent

__all__ = ["HDF5Source", "detect_hdf5", "open_hdf5", "SIGNATURE", "MAX_OBJECTS"]

#: The 8-byte HDF5 superblock signature (at offset 0, 512, 1024, 2048, ...).
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: Most groups + datasets walked in one file.
MAX_OBJECTS = 1_000_000
_ZERO_COPY_KINDS = "biufc"
_LAYOUT_CONTIGUOUS, _LAYOUT_VIRTUAL = 1, 3


def detect_hdf5(head: bytes, path: str | os.PathLike | None = None) -> bool:
    """Whether a file holds the HDF5 signature at offset 0, 512, 1024, 2048, ...

    ``head`` is the file's first bytes; when ``path`` is given, later
    power-of-two offsets are read from the file.

    >>> detect_hdf5(b"\\x89HDF\\r\\n\\x1a\\n" + bytes(8))
    True
    """
    head = bytes(head)
    if head[:8] == SIGNATURE:
        return True
    off = 512
    while off + 8 <= len(head):
        if head[off : off + 8] == SIGNATURE:
            return True
        off *= 2
    if path is None:
        return False
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            while off + 8 <= size:
                fh.seek(off)
                if fh.read(8) == SIGNATURE:
                    return True
                off *= 2
    except OSError:
        return False
    return False


def _plain(value: Any) -> Any:
    """An attribute or scalar dataset value as plain Python (arrays become lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O" or value.dtype.kind == "S":
            return [_plain(v) for v in value.reshape(-1).tolist()] if value.ndim else _plain(value.item())
        return value.tolist() if value.dtype.fields is None else value
    if isinstance(value, np.generic):
        return value.item() if value.dtype.fields is None else value
    return value


def _attrs(obj: Any, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        names = list(obj.attrs.keys())
    except Exception as e:  # noqa: BLE001 - h5py raises many kinds on corrupt files
        raise BadArchiveError(f"{where}: cannot list attributes of {obj.name!r}: {e}") from None
    for name in names:
        try:
            out[name] = _plain(obj.attrs[name])
        except Exception:  # noqa: BLE001 - an attribute of a type h5py cannot read: left out
            continue
    return out


class HDF5Source(TreeSource):
    """An HDF5 file as a tree; keeps the h5py file open for the loaders until :meth:`close`."""

    _h5: Any = None
    #: Attributes of every group and dataset that has some, by tree path ("" the root, "g", "g/w").
    _attrs: dict[str, dict[str, Any]]
    #: A group's attributes by the prefix of its level.
    _level_attrs: dict[str, dict[str, Any]]

    def attributes(self, path: str) -> dict[str, Any]:
        """The attributes of the group or dataset at ``path`` (``""``: the root; ``{}`` when none)."""
        return dict(getattr(self, "_attrs", {}).get(path.strip("/"), {}))

    def level_metadata(self, prefix: str) -> dict[str, Any]:
        """A group's attributes, the ``metadata`` of its level (``prefix``: the source's level prefix)."""
        return dict(getattr(self, "_level_attrs", {}).get(prefix, {}))

    def close(self) -> None:
        if self._h5 is not None:
            try:
                self._h5.close()
            finally:
                self._h5 = None
        super().close()


class _Group(dict):
    """A level of the tree with the group's attributes."""

    meta: dict[str, Any]


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


def _refused(name: str, why: str):
    def load() -> None:
        raise UnsupportedError(f"dataset {name!r}: {why}")

    return load


class _Ctx:
    """What the walk of one file needs: the input's folder and whether other files may be read."""

    def __init__(self, h5: Any, folder: Path, where: str, allow_external: bool) -> None:
        self.h5 = h5
        self.folder = folder
        self.where = where
        self.allow_external = allow_external


def _check_inside(ctx: _Ctx, name: str, entry: str) -> None:
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


def _external_loader(ctx: _Ctx, dset: Any, plist: Any, native: np.dtype, nbytes: int, where: str):
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


def _reopened(ctx: _Ctx, dset: Any) -> Any:
    """``dset`` opened again with virtual sources looked up in the input's folder."""
    import h5py  # type: ignore[import-untyped]

    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_virtual_prefix(os.fsencode(os.path.abspath(ctx.folder)) + b"/")
    return h5py.Dataset(h5py.h5d.open(dset.file.id, dset.name.encode(), dapl=dapl))


def _dataset(dset: Any, key: str, f: MappedFile, where: str, ctx: _Ctx, foreign: bool = False) -> Any:
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
                _check_inside(ctx, name, f"dataset {dset.name!r}")
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
                loader=_refused(dset.name, reason),
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
        return _plain(value)
    if shape == ():
        try:
            return _plain(dset[()])
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot read dataset {dset.name!r}: {e}") from None
    if tdtype is None:  # compound, opaque, references...: a numpy value
        try:
            return dset[()]
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{where}: cannot read dataset {dset.name!r}: {e}") from None
    layout = plist.get_layout()
    offset = dset.id.get_offset() if layout == _LAYOUT_CONTIGUOUS and not foreign else None
    if offset is not None and dtype.isnative and plist.get_nfilters() == 0:
        nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
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


def _soft_through_external(ctx: _Ctx, group: Any, path: str) -> Any:
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


def _follow(ctx: _Ctx, group: Any, name: str, link: Any) -> bool:
    """Whether the link ``name`` of ``group`` may be followed (no file outside the rule)."""
    import h5py  # type: ignore[import-untyped]

    ext = link if isinstance(link, h5py.ExternalLink) else None
    if isinstance(link, h5py.SoftLink):
        ext = _soft_through_external(ctx, group, link.path)
    if ext is None:
        return True
    if not ctx.allow_external:
        return False  # another file: not followed
    _check_inside(ctx, ext.filename, f"external link {group.name.rstrip('/')}/{name}")
    return True


def h5_string(dtype: np.dtype) -> bool:
    import h5py  # type: ignore[import-untyped]

    return h5py.check_string_dtype(dtype) is not None


def open_hdf5(path: str | os.PathLike, *, allow_external: bool = False, **kw: Any) -> HDF5Source:
    """Opens an HDF5 file (needs h5py): see the module docstring for what each object becomes.

    Parameters
    ----------
    path : str or os.PathLike
        The HDF5 file.
    allow_external : bool
        Read virtual datasets, external raw storage and external links whose
        files are regular files inside ``path``'s folder (the rule of
        :mod:`tdz_numba.files.confine`); by default none of them is read.

    Raises
    ------
    UnsupportedError
        h5py is not installed.
    BadArchiveError
        A file h5py cannot read.
    UnsafeContentError
        With ``allow_external=True``: another file outside the folder
        (:class:`~tdz_numba.files.confine.OutsideError`).
    """
    try:
        import h5py  # type: ignore[import-untyped]
    except ImportError:
        raise UnsupportedError(
            f"{path}: reading HDF5 files needs h5py (pip install 'tdz_numba[hdf5]')"
        ) from None
    where = str(path)
    f = MappedFile.open(path)
    h5 = None
    try:
        try:
            h5 = h5py.File(path, "r")
        except Exception as e:  # noqa: BLE001 - OSError for most, others on odd files
            raise BadArchiveError(f"{where}: not a readable HDF5 file: {e}") from None
        ctx = _Ctx(h5, Path(os.path.dirname(os.path.abspath(path))), where, allow_external)
        root = _Group()
        root.meta = {}
        metadata = _attrs(h5, where)
        attrs: dict[str, dict[str, Any]] = {"": metadata} if metadata else {}
        visited = {h5.id}
        stack: list[tuple[Any, _Group, int, str]] = [(h5, root, 0, "")]
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
                    if not _follow(ctx, group, name, link):
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
                    sub = _Group()
                    sub.meta = _attrs(obj, where)
                    if sub.meta:
                        attrs[prefix + name] = sub.meta
                    node[name] = sub
                    stack.append((obj, sub, depth + 1, f"{prefix}{name}/"))
                elif isinstance(obj, h5py.Dataset):
                    try:
                        foreign = obj.file.id.fileno != h5.id.fileno  # reached by an external link
                        node[name] = _dataset(obj, name, f, where, ctx, foreign)
                        try:
                            own = _attrs(obj, where)
                        except BadArchiveError:  # a description only: the data read or fail on their own
                            own = {}
                        if own:
                            attrs[prefix + name] = own
                    except TdzError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        raise BadArchiveError(f"{where}: cannot describe dataset {obj.name!r}: {e}") from None
                # committed datatypes are not data: left out
        src = HDF5Source("hdf5", path, root, files=[f], metadata=metadata)
    except BaseException:
        if h5 is not None:
            h5.close()
        f.close()
        raise
    src._h5 = h5
    src._attrs = attrs
    _set_level_meta(src, root)
    return src


def _set_level_meta(src: TreeSource, root: _Group) -> None:
    """Copies each group's attributes into its level (the levels' prefixes are the source's)."""
    stack: list[tuple[str, _Group]] = [("", root)]
    by_level: dict[str, dict[str, Any]] = {}
    src._level_attrs = by_level  # type: ignore[attr-defined]
    while stack:
        prefix, node = stack.pop()
        info = src.level(prefix)
        if node.meta and prefix:
            by_level[prefix] = node.meta
            src._levels[prefix] = info._replace(meta={**node.meta, **info.meta})
        for key, child in info.children.items():
            if child.kind == "level":
                stack.append((child.path, node[key]))
