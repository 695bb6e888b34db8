"""A tensordict memmap directory under a URL prefix (``s3://bucket/run/td/``, ``memory://...``).

The walk is the local reader's (:mod:`tdz_numba.formats.memmap_dir`), on the filesystem's
listing: each level's ``meta.json`` is read (one request per level), a level that does
not list its children is listed (``fs.ls``, which also gives each file's size and
identity), and each leaf's ``.memmap`` file becomes a :class:`~tdz_numba.remote.foreign.RemoteFile`
sized and pinned from that listing, so that opening fetches no payload. Paths stay
inside the prefix: the names come from ``meta.json`` and the listing, and a name with
``/``, ``\\`` or ``..`` is refused.

Examples
--------
>>> import fsspec, tempfile, pathlib, torch, tdz_numba
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> d = tdz_numba.unpack(tdz_numba.save({"a": {"b": torch.arange(3)}}, d / "x.tdz"), d / "x")
>>> fs = fsspec.filesystem("memory"); fs.put(str(d), "/doc-md/dir", recursive=True)
>>> with tdz_numba.open("memory://doc-md/dir") as ar:
...     print(ar.format, ar["a/b"].tolist())
memmap_dir [0, 1, 2]
>>> fs.rm("/doc-md", recursive=True)
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from ..errors import BadArchiveError
from ..formats.memmap_dir import MAX_FILE_BYTES, MAX_META_BYTES, leaf_claims
from ..tdz.source import PICKLE_SUFFIXES
from ..tdz.sources import MAX_DEPTH, MappedFile, TensorSpec, TreeSource, check_extent
from ..tdz.tree import Level, PickledData, RawFile, describe_level
from .foreign import RemoteFile
from .object import RemoteObject
from .transports import _pin_of

__all__ = ["is_memmap_dir", "open_memmap_dir_remote"]


def is_memmap_dir(url: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether ``url`` is a prefix holding a ``meta.json`` (one metadata request)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        return bool(fs.isfile(path.rstrip("/") + "/meta.json"))
    except Exception:  # noqa: BLE001 - not a directory: the caller's error stands
        return False


def _safe(name: str, where: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise BadArchiveError(f"{where}: {name!r} is not a name inside the directory", path=where)
    return name


def open_memmap_dir_remote(url: str, storage_options: dict[str, Any] | None) -> TreeSource:
    """The memmap directory at ``url`` as a :class:`~tdz_numba.tdz.sources.TreeSource`."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(url, **(storage_options or {}))
    base = base.rstrip("/")
    top = url.rstrip("/")
    files: list[MappedFile] = []
    listed: dict[str, dict[str, dict[str, Any]]] = {}

    def ls(prefix: str) -> dict[str, dict[str, Any]]:
        if prefix not in listed:
            try:
                entries = fs.ls(base + "/" + prefix.rstrip("/") if prefix else base, detail=True)
            except (FileNotFoundError, OSError, ValueError):
                entries = []
            listed[prefix] = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
        return listed[prefix]

    def listing(prefix: str) -> tuple[set[str], set[str]]:
        found = ls(prefix)
        files_ = {n for n, e in found.items() if e.get("type") != "directory"}
        return files_, {n for n, e in found.items() if e.get("type") == "directory"}

    def lookup(rel: str) -> dict[str, Any] | None:
        """A file's listing entry (size, identity): from ``fs.ls`` of its folder, else ``fs.info``
        (an HTTP server lists no folders)."""
        folder, _, name = rel.rpartition("/")
        found = ls(folder + "/" if folder else "").get(name)
        if found is None:
            try:
                found = dict(fs.info(base + "/" + rel))
            except (FileNotFoundError, OSError):
                return None
        return found

    def has_level(sub: str) -> bool:
        return bool(fs.isfile(base + "/" + sub.rstrip("/") + "/meta.json"))

    def read(rel: str, limit: int) -> bytes:
        try:
            data = fs.cat_file(base + "/" + rel)
        except FileNotFoundError:
            raise BadArchiveError(f"{top}/{rel}: missing", path=top) from None
        if len(data) > limit:
            raise BadArchiveError(f"{top}/{rel}: {len(data)} bytes, more than {limit}", path=top)
        return bytes(data)

    out: Level | None = None
    stack: list[tuple[str, int, Level | None, str]] = [("", 0, None, "")]
    while stack:
        prefix, depth, parent, pkey = stack.pop()
        where = f"{top}/{prefix}".rstrip("/")
        if depth > MAX_DEPTH:
            raise BadArchiveError(f"{where}: levels nested deeper than {MAX_DEPTH}")
        try:
            meta = json.loads(read(prefix + "meta.json", MAX_META_BYTES).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise BadArchiveError(f"{where}/meta.json: not valid JSON: {exc}", path=top) from None
        keyed, children = describe_level(
            meta, prefix, partial(listing, prefix), has_level, f"{where}/meta.json"
        )
        keys = {c.key for c in children}
        level = Level(
            meta={k: v for k, v in meta.items() if k not in keys} if keyed else dict(meta), keyed=keyed
        )
        if parent is None:
            out = level
        else:
            parent[pkey] = level
        for c in children:
            for part in c.path.rstrip("/").split("/"):
                _safe(part, where)
            if c.kind == "level":
                level[c.key] = None
                stack.append((c.path, depth + 1, level, c.key))
            elif c.kind == "file":
                data = read(c.path, MAX_FILE_BYTES)
                level[c.key] = PickledData(data) if c.path.endswith(PICKLE_SUFFIXES) else RawFile(data)
            else:
                level[c.key] = _leaf(storage_options, top, c.leaf, files, where, lookup)
    assert out is not None
    return TreeSource("memmap_dir", top, out, files=files, metadata={}, level_meta={"": out.meta})


def _leaf(
    storage: dict[str, Any] | None, top: str, leaf: Any, files: list[MappedFile], where: str, ls: Any
) -> TensorSpec:
    entry, dtype, nbytes = leaf_claims(leaf, where)
    if nbytes == 0:
        return TensorSpec(leaf.key, dtype, leaf.shape, None, 0, 0, 0, leaf.dtype)
    info = ls(leaf.entry)
    if info is None:
        raise BadArchiveError(
            f"{entry}: leaf {leaf.key!r} of shape {list(leaf.shape)} has no file {leaf.entry!r}"
        )
    obj = RemoteObject(f"{top}/{leaf.entry}", storage)
    obj.sized(int(info.get("size") or 0), _pin_of(info))
    f = RemoteFile(obj)
    files.append(f)
    if f.size < nbytes:
        raise BadArchiveError(
            f"{entry}: leaf {leaf.key!r} ({leaf.dtype}, shape {list(leaf.shape)}) needs "
            f"{nbytes} bytes, the file holds {f.size}"
        )
    spec = TensorSpec(leaf.key, dtype, leaf.shape, None, len(files) - 1, 0, nbytes, leaf.dtype)
    check_extent(spec, f.size, entry)
    return spec
