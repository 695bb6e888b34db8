"""A tensordict memmap directory (``TensorDict.memmap(dir)``, ``tdz unpack``) opened in place.

The directory holds the same tree as a packed ``.tdz`` archive: a
``meta.json`` per level, one ``<key>.memmap`` file per tensor leaf. Each level's
``meta.json`` is read with the archive's own
:func:`~tdz_numba.tdz.tree.describe_level`, each payload file is mapped once and
its leaf is a zero-copy view. NonTensorData levels come back as plain values,
other files (``other.pickle``, ``json_types.json``) as
:class:`~tdz_numba.tdz.tree.RawFile`/:class:`~tdz_numba.tdz.tree.PickledData` values,
never unpickled.

Every file and sub-level is opened through :mod:`tdz_numba.files.confine`:
inside the directory only (a ``.memmap`` leaf, sub-level or ``other.pickle``
that is a symlink leading outside is refused; a symlink whose target stays
inside is followed), regular files only (a FIFO or device such as
``/dev/zero`` is refused before anything is read), other files read up to
:data:`MAX_FILE_BYTES`. A ``.memmap`` file longer than its tensor is read as
tensordict reads it (the leading bytes; the rest is ignored); a shorter one is
refused.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.formats import memmap_dir, to_tree
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": {"b": torch.arange(3)}, "tag": "x"}, pathlib.Path(d) / "x.tdz")
...     out = tdz_numba.unpack(p, pathlib.Path(d) / "dir")
...     tree = to_tree(memmap_dir.open_memmap_dir(out))
...     print(tree["a"]["b"].tolist(), tree["tag"])
[0, 1, 2] x
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import BadArchiveError, UnsupportedError
from ..files.confine import (
    MemberMissingError,
    NotRegularError,
    map_inside,
    open_dir_inside,
    read_inside,
)
from ..tdz.dtypes import torch_dtype
from ..tdz.source import PICKLE_SUFFIXES
from ..tdz.sources import MAX_DEPTH, MappedFile, TensorSpec, TreeSource, check_extent
from ..tdz.tree import NON_TENSOR_DATA_TYPE, Level, PickledData, RawFile, describe_level
from ._shape import check_shape

__all__ = ["open_memmap_dir", "leaf_claims", "MAX_META_BYTES", "MAX_FILE_BYTES"]

#: Largest meta.json read.
MAX_META_BYTES = 64 << 20
#: Largest other file (``other.pickle``, ``json_types.json``) read into memory.
MAX_FILE_BYTES = 1 << 30


def _listing(root: Path, prefix: str, fd: int, where: str) -> tuple[set[str], set[str]]:
    """Files and folders of the level at ``prefix`` (an open descriptor of it); a symlink
    counts as what it leads to inside the root (one leading outside is refused)."""
    files: set[str] = set()
    dirs: set[str] = set()
    with os.scandir(fd) as it:
        for e in it:
            if e.is_symlink():
                try:
                    os.close(open_dir_inside(root, prefix + e.name, where=where, entry=e.name))
                    dirs.add(e.name)
                except NotRegularError:
                    files.add(e.name)
            else:
                (dirs if e.is_dir(follow_symlinks=False) else files).add(e.name)
    return files, dirs


def _has_level(root: Path, sub: str, where: str) -> bool:
    try:
        os.close(open_dir_inside(root, sub, where=where, entry=sub))
    except (MemberMissingError, NotRegularError):
        return False
    return True


def _read_meta(root: Path, prefix: str, where: str) -> Any:
    try:
        data = read_inside(
            root, prefix + "meta.json", where=where, entry="meta.json", max_bytes=MAX_META_BYTES
        )
    except MemberMissingError:
        raise BadArchiveError(f"{where}: no meta.json") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadArchiveError(f"{where}/meta.json: not valid JSON: {exc}") from None


def open_memmap_dir(path: str | os.PathLike, **options: Any) -> TreeSource:
    """A memmap directory as a :class:`~tdz_numba.tdz.sources.TreeSource` (the tree a packed archive has).

    Raises
    ------
    BadArchiveError
        A missing or malformed ``meta.json``, a payload file shorter than its
        tensor, a directory reached twice (symlink loops), nesting deeper than
        ``MAX_DEPTH``, a FIFO/device/socket (:class:`~tdz_numba.files.confine.NotRegularError`).
    UnsafeContentError
        A file or sub-level reached through a symlink that leaves the directory
        (:class:`~tdz_numba.files.confine.OutsideError`).
    UnsupportedError
        Nested (jagged) tensor leaves.
    """
    root = Path(path)
    files: list[MappedFile] = []
    try:
        tree = _walk(root, files)
    except BaseException:
        for f in files:
            f.close()
        raise
    return TreeSource("memmap_dir", root, tree, files=files, metadata={}, level_meta={"": tree.meta})


def _walk(root: Path, files: list[MappedFile]) -> Level:
    seen: set[tuple[int, int]] = set()
    out: Level | None = None
    top = str(root)
    # (directory prefix, depth, parent level, key in parent)
    stack: list[tuple[str, int, Level | None, str]] = [("", 0, None, "")]
    while stack:
        prefix, depth, parent, pkey = stack.pop()
        where = str(root / prefix) if prefix else top
        if depth > MAX_DEPTH:
            raise BadArchiveError(f"{where}: levels nested deeper than {MAX_DEPTH}")
        fd = open_dir_inside(root, prefix or ".", where=top, entry=prefix or ".")
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                raise BadArchiveError(f"{where}: directory reached twice (a symlink loop?)")
            seen.add((st.st_dev, st.st_ino))
            meta = _read_meta(root, prefix, where)
            keyed, children = describe_level(
                meta,
                prefix,
                lambda prefix=prefix, fd=fd: _listing(root, prefix, fd, top),  # type: ignore[misc]
                lambda sub: _has_level(root, sub, top),
                f"{where}/meta.json",
            )
        finally:
            os.close(fd)
        if (
            not keyed
            and meta.get("_type") == NON_TENSOR_DATA_TYPE
            and meta.get("_metadata") is None
            and "data" in meta
            and not isinstance(meta["data"], dict)
        ):
            value: Any = meta["data"]
            if parent is None:
                out = Level({"data": value}, meta=meta, keyed=False)
            else:
                parent[pkey] = value
            continue
        keys = {c.key for c in children}
        own = {k: v for k, v in meta.items() if k not in keys} if keyed else dict(meta)
        level = Level(meta=own, keyed=keyed)
        if parent is None:
            out = level
        else:
            parent[pkey] = level
        for c in children:
            if c.kind == "level":
                level[c.key] = None  # keeps the order; filled when its directory is read
                stack.append((c.path, depth + 1, level, c.key))
            elif c.kind == "file":
                data = read_inside(root, c.path, where=top, entry=c.path, max_bytes=MAX_FILE_BYTES)
                level[c.key] = PickledData(data) if c.path.endswith(PICKLE_SUFFIXES) else RawFile(data)
            else:
                level[c.key] = _leaf(root, c.leaf, files, where)
    assert out is not None
    return out


def leaf_claims(leaf: Any, where: str) -> tuple[str, Any, int]:
    """A leaf's label in messages, torch dtype and byte count, its claims checked (the local
    reader's and the one under a URL prefix, :mod:`tdz_numba.remote.memmapdir`)."""
    entry = f"{where}: {leaf.entry}"
    dtype = torch_dtype(leaf.dtype, entry=entry)
    if leaf.nested:
        raise UnsupportedError(f"{entry}: nested (jagged) tensor leaves are not read from memmap directories")
    check_shape(leaf.shape, None, dtype.itemsize, f"{entry}: leaf {leaf.key!r}")
    return entry, dtype, math.prod(leaf.shape) * dtype.itemsize


def _leaf(root: Path, leaf: Any, files: list[MappedFile], where: str) -> TensorSpec:
    entry, dtype, nbytes = leaf_claims(leaf, where)
    if nbytes == 0:
        return TensorSpec(leaf.key, dtype, leaf.shape, None, 0, 0, 0, leaf.dtype)
    try:
        mm, size = map_inside(root, leaf.entry, where=str(root), entry=leaf.entry)
    except MemberMissingError:
        raise BadArchiveError(
            f"{entry}: leaf {leaf.key!r} of shape {list(leaf.shape)} has no file {leaf.entry!r}"
        ) from None
    f = MappedFile(root / leaf.entry, mm, size, False)
    files.append(f)
    if f.size < nbytes:  # trailing bytes are not an error (tensordict reads the first nbytes)
        raise BadArchiveError(
            f"{entry}: leaf {leaf.key!r} ({leaf.dtype}, shape {list(leaf.shape)}) needs "
            f"{nbytes} bytes, the file holds {f.size}"
        )
    spec = TensorSpec(leaf.key, dtype, leaf.shape, None, len(files) - 1, 0, nbytes, leaf.dtype)
    check_extent(spec, f.size, entry)
    return spec
