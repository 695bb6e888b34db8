"""HDF5 files: groups as levels, contiguous datasets mapped zero-copy, h5py (optional) for the rest.

The reader reads the file's structure itself (superblock, object headers,
group links: :mod:`~tdz_numba.formats.hdf5_objects`,
:mod:`~tdz_numba.formats.hdf5_headers`, :mod:`~tdz_numba.formats.hdf5_walk`):
the group tree is walked iteratively (depth limited to
:data:`~tdz_numba.tdz.sources.MAX_DEPTH`, each group visited once even when hard
or soft links make cycles), and whether an object is a group, a plain dataset,
a virtual dataset or one with external storage is decided from its header
before libhdf5 opens it. Each dataset becomes a leaf:

- contiguous, unfiltered, allocated datasets of a little-endian numeric dtype
  (IEEE floats, full-precision integers): a
  :class:`~tdz_numba.tdz.sources.TensorSpec` at the data address read from the
  layout message (zero-copy, bounds checked against the file size), made
  without any h5py call;
- chunked, filtered (gzip, ...), compact, not yet allocated, big-endian
  datasets, h5py's bool and complex types: through h5py (contiguous native
  ones zero-copy at ``get_offset()``, the others a spec whose ``loader`` reads
  it through h5py, a copy); its
  ``codec`` says how it is stored (``"chunked+shuffle+gzip"``, ``"compact"``,
  ``"unallocated"``) and ``nbytes`` the bytes it occupies in the file;
- scalars and strings: plain Python values (``str`` for strings, lists for
  string arrays); compound/opaque datasets: a numpy array read at open.

Attributes are read by this reader itself (:mod:`~tdz_numba.formats.hdf5_attrs`:
numbers, fixed and variable-length strings, booleans; h5py reads the other
well-formed types) as h5py's values made plain (Python scalars/lists, strings
decoded): the root group's are the file's ``metadata``, another group's are
its level's ``metadata`` (``ar["g"].metadata``), a dataset's are its
``ar.info(k).attrs``; :meth:`HDF5Source.attributes` gives any object's
(``ar.source.attributes("g/w")``), :meth:`HDF5Source.skipped_attributes` those
left out and why.

Variable-length data (strings, sequences, compounds and arrays holding them) live in global
heap collections, on some damaged ones of which libhdf5 loops forever: before h5py reads such a
dataset, :mod:`~tdz_numba.formats.hdf5_vlen` reads its references itself (compact and
contiguous data, the fill value, each chunk) and walks every collection they name; a damaged
one is a :class:`~tdz_numba.BadArchiveError` naming the dataset, and variable-length data it
cannot check (chunks with a filter other than deflate/shuffle/Fletcher-32, virtual datasets) a
leaf that raises :class:`~tdz_numba.UnsupportedError` when read.

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

The h5py file is opened only when some object needs it, and stays open for
the loaders until :meth:`HDF5Source.close`.
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

import gc
import os
from pathlib import Path
from typing import Any, cast

from ..errors import UnsupportedError
from ..files.scanadvice import header_scan
from ..tdz.sources import MappedFile, TreeSource
from ._flat import flat_source
from .hdf5_h5py import Ctx, Group, h5_string
from .hdf5_objects import SIGNATURE, Layout
from .hdf5_walk import MAX_OBJECTS, Walk

__all__ = ["HDF5Source", "detect_hdf5", "open_hdf5", "SIGNATURE", "MAX_OBJECTS", "h5_string"]


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
    try:  # 8 bytes a read (a buffered file read 8 KiB at each offset: ~80 us for a 512 MiB file)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        while off + 8 <= size:
            if os.pread(fd, 8, off) == SIGNATURE:
                return True
            off *= 2
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


class HDF5Source(TreeSource):
    """An HDF5 file as a tree; keeps the h5py file open for the loaders until :meth:`close`."""

    _h5: Any = None
    #: Attributes of every group and dataset that has some, by tree path ("" the root, "g", "g/w").
    _attrs: dict[str, dict[str, Any]]
    #: Attributes left out, by tree path: name -> why.
    _skipped: dict[str, dict[str, str]]
    #: A group's attributes by the prefix of its level.
    _level_attrs: dict[str, dict[str, Any]]

    def attributes(self, path: str) -> dict[str, Any]:
        """The attributes of the group or dataset at ``path`` (``""``: the root; ``{}`` when none)."""
        return dict(getattr(self, "_attrs", {}).get(path.strip("/"), {}))

    def skipped_attributes(self, path: str) -> dict[str, str]:
        """Attributes of the object at ``path`` left out, with why (a reference, a variable-length
        member of a compound, a type in the shared-message heap: :mod:`~tdz_numba.formats.hdf5_attrs`)."""
        return dict(getattr(self, "_skipped", {}).get(path.strip("/"), {}))

    def leaf_attributes(self, prefix: str, key: str) -> dict[str, Any]:
        """The attributes of the dataset ``key`` of the level at ``prefix`` (the source's level
        prefix): ``Archive.info(k).attrs``."""
        base = getattr(self, "_tree_paths", {}).get(prefix, "")
        return self.attributes(base + key)

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
        import h5py  # type: ignore[import-untyped]  # noqa: F401 - read what the reader does not map
    except ImportError:
        raise UnsupportedError(
            f"{path}: reading HDF5 files needs h5py (pip install 'tdz_numba[hdf5]')"
        ) from None
    where = str(path)
    f = MappedFile.open(path)
    if f.remote and allow_external:
        f.close()
        raise UnsupportedError(
            f"{where}: allow_external=True makes libhdf5 open the other files itself, and it reads "
            f"local files only: copy the files to a local folder first"
        )
    walk = None
    try:
        lay = Layout.read(f.buffer, where)
        ctx = Ctx(None, Path(os.path.dirname(os.path.abspath(path))), where, allow_external)
        collecting = gc.isenabled()
        gc.disable()  # tens of thousands of specs, no cycles: the collector's passes would cost more
        try:
            with header_scan(f, in_load=False) as scan:  # (object headers far apart: their pages only)
                walk = Walk(lay, f, ctx, os.fspath(path), scan)
                root, metadata = walk.run()
            if root.columns is not None:  # one level of specs made in one pass (hdf5_walk)
                made = flat_source(
                    "hdf5", path, root, files=[f], metadata=metadata, cls=HDF5Source, meta=root.meta
                )
                src = cast(HDF5Source, made)
            else:
                src = HDF5Source("hdf5", path, root, files=[f], metadata=metadata)
        finally:
            if collecting:
                gc.enable()
    except BaseException:
        if walk is not None and walk.h5 is not None:
            walk.h5.close()
        f.close()
        raise
    src._h5 = walk.h5
    src._attrs = walk.attrs
    src._skipped = walk.skipped
    if metadata:
        src._attrs[""] = metadata
    _set_level_meta(src, root)
    return src


def _set_level_meta(src: TreeSource, root: Group) -> None:
    """Copies each group's attributes into its level (the levels' prefixes are the source's)."""
    stack: list[tuple[str, Group, str]] = [("", root, "")]
    by_level: dict[str, dict[str, Any]] = {}
    src._level_attrs = by_level  # type: ignore[attr-defined]
    paths: dict[str, str] = {}  # level prefix -> tree path ("g/" for the level of group g)
    src._tree_paths = paths  # type: ignore[attr-defined]
    while stack:
        prefix, node, tree = stack.pop()
        paths[prefix] = tree
        info = src.level(prefix)
        if node.meta and prefix:
            by_level[prefix] = node.meta
            src._levels[prefix] = info._replace(meta={**node.meta, **info.meta})
        if node.columns is not None:  # (specs only: no sub-level)
            continue
        for key, child in info.children.items():
            if child.kind == "level":
                stack.append((child.path, node[key], f"{tree}{key}/"))
