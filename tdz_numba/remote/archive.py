"""Opening remote files: :func:`open_remote` (any format over an fsspec URL or a file object),
:func:`load_remote`, :func:`verify_remote`, :func:`is_archive_remote`, and :class:`RemoteArchive`,
the :class:`~tdz_numba.Archive` over a remote ``.tdz`` (:class:`~tdz_numba.remote.read.RemoteIndex`:
the ranged reads).

Examples
--------
>>> import fsspec, torch, tdz_numba
>>> from tdz_numba.remote.archive import is_archive_remote, load_remote
>>> _ = tdz_numba.save({"a": torch.arange(3)}, "memory://doc/y.tdz")
>>> is_archive_remote("memory://doc/y.tdz"), load_remote("memory://doc/y.tdz")["a"].tolist()
(True, [0, 1, 2])
>>> fsspec.filesystem("memory").rm("memory://doc/y.tdz")
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..archive.mapping import Archive
from ..archive.options import DEFAULT, OpenOptions
from ..archive.state import ArchiveState, subpath_prefix
from ..errors import BadArchiveError, FileMissingError, InvalidArgumentError, MissingKeyError, TdzError
from ..formats.detect import zip_kind
from ..tdz.source import TdzSource
from ..zipfmt import records
from .object import RemoteObject
from .read import TAIL_BYTES, WALK_LEVELS, RemoteIndex

__all__ = ["RemoteArchive", "open_remote", "load_remote", "verify_remote", "is_archive_remote"]


class RemoteArchive(Archive):
    """An :class:`~tdz_numba.Archive` over a :class:`RemoteIndex`: ``to_dict`` fetches every
    entry below the level in one coalesced, concurrent batch first."""

    def __init__(self, state: ArchiveState, prefix: str = "") -> None:
        # unlike a local open, the level's meta.json is fetched when first needed (listing,
        # a key, to_dict): opening costs the tail read only
        self._state = state
        self._prefix = prefix

    def _sub(self, prefix: str) -> Archive:
        views = self._state.views
        view = views.get(prefix)
        if view is None:
            view = views[prefix] = RemoteArchive(self._state, prefix)
            if len(views) == WALK_LEVELS:  # a walk (tree, iter_leaves): every meta.json at once
                self._index.fetch_levels()
        return view

    def to_dict(self, **kwargs: Any):  # noqa: D102 - Archive.to_dict
        self._index.fetch_prefix(self._prefix)
        return super().to_dict(**kwargs)

    @property
    def url(self) -> str:
        """The object's URL (or the file object's name)."""
        return str(self._index.path)


def open_remote(
    target: Any,
    options: OpenOptions = DEFAULT,
    *,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    tail_bytes: int = TAIL_BYTES,
) -> Archive:
    """Opens a remote file of any format lazily; see :func:`tdz_numba.open`.

    Parameters
    ----------
    target : str or file object
        An fsspec URL (``s3://``, ``gs://``, ``https://``, ``memory://``, ...)
        or a seekable binary file object (an ``fsspec`` file, ``io.BytesIO``).
    storage_options : dict, optional
        Passed to the fsspec filesystem (credentials, endpoint, ...).
    verify : bool
        Check the CRC-32 of every fetched STORED entry (compressed entries are
        always checked when inflated).
    tail_bytes : int
        Bytes read from the end at open (end records + central directory).

    Examples
    --------
    >>> import io, torch, tdz_numba
    >>> from tdz_numba.remote.archive import open_remote
    >>> buf = io.BytesIO()
    >>> _ = tdz_numba.save({"x": torch.ones(3)}, buf)
    >>> ar = open_remote(buf)
    >>> print(ar["x"].tolist(), ar._index.requests)
    [1.0, 1.0, 1.0] 1
    """
    mode, subpath, allow_pickle, num_threads, copy, device, dtype = options[:7]
    if mode != "r":
        raise InvalidArgumentError(f"{target}: remote archives are read-only: mode must be 'r', got {mode!r}")
    if not isinstance(tail_bytes, int) or tail_bytes < records.End.SIZEOF:
        raise InvalidArgumentError(
            f"tail_bytes must be an int >= {int(records.End.SIZEOF)}, got {tail_bytes!r}"
        )
    from . import foreign

    obj = target if isinstance(target, RemoteObject) else RemoteObject(target, storage_options)
    if obj.size < 0:
        try:
            foreign.start(obj, tail_bytes)
        except FileMissingError:
            from .memmapdir import is_memmap_dir, open_memmap_dir_remote

            if not isinstance(target, str) or not is_memmap_dir(target, storage_options):
                raise
            return _foreign_archive(open_memmap_dir_remote(target, storage_options), options)
    if not foreign.is_zip(obj, tail_bytes):
        extra = {"allow_external": True} if options.allow_external else {}  # HDF5 refuses it for a URL
        return _foreign_archive(foreign.open_foreign(obj, extra), options)
    index = RemoteIndex(obj, verify=verify, tail_bytes=tail_bytes)
    label = index.path
    kind = zip_kind(index.names, str(label))
    if kind != "tdz":
        return _foreign_archive(foreign.open_foreign_zip(kind, index, {}), options)

    prefix = subpath_prefix(subpath)
    if prefix and prefix + "meta.json" not in index:
        raise MissingKeyError(
            f"{label}: no level at subpath {subpath!r} (no entry {prefix + 'meta.json'!r})",
            path=label,
            entry=prefix + "meta.json",
        )
    if "meta.json" not in index:
        raise BadArchiveError(f"{label}: not a tensor archive: no top-level meta.json entry", path=label)
    source = TdzSource(index.path, allow_pickle=allow_pickle, num_threads=num_threads, index=index)
    return RemoteArchive(ArchiveState(source, copy=copy, device=device, dtype=dtype), prefix)


def _foreign_archive(source: Any, options: OpenOptions) -> Archive:
    """An :class:`~tdz_numba.Archive` over a remote source of another format (``subpath`` as
    for a local open)."""
    _, subpath, _, _, copy, device, dtype = options[:7]
    source.copy = copy
    state = ArchiveState(source, copy=copy, device=device, dtype=dtype)
    state.aligned = bool(options.aligned)
    state.dequantize = bool(options.dequantize)
    try:
        root = Archive(state, "")
        if subpath is None or subpath_prefix(subpath) == "":
            return root
        return root.sublevel(subpath)
    except BaseException:
        source.close()
        raise


def load_remote(
    target: Any,
    options: OpenOptions = DEFAULT,
    *,
    nest: str | None = None,
    storage_options: dict[str, Any] | None = None,
):
    """Loads a remote archive (or the level at ``options.subpath``) as nested dicts, fetching only
    its entries, in one coalesced batch; ``dtype``, ``device`` and ``copy`` as for a local load;
    see :func:`tdz_numba.load`."""
    ar = open_remote(target, options, storage_options=storage_options)
    try:
        return ar.to_dict(nest=nest)
    finally:
        ar.close()


def verify_remote(
    target: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = None,
    deep: bool = False,
):
    """Fetches the whole object and checks every CRC-32 and the structure; see :func:`tdz_numba.verify`.
    ``deep``: then every stored XXH3-128 digest is recomputed from the fetched bytes
    (:func:`~tdz_numba.archive.verify_deep.check_digests`)."""
    from ..archive.verify import VerifyReport, verify_compressed
    from ..files.progress import progress as _progress

    ar = open_remote(target, storage_options=storage_options)
    try:
        if ar.format != "tdz":
            from .foreign import verify_foreign

            return verify_foreign(ar, progress)
        index = ar._index
        obj = index.obj
        todo = sum(b - a for a, b in obj.missing(0, obj.size))
        with _progress(todo, "fetch", enabled=progress) as bar:
            obj.progress = bar.update  # bytes and bytes per second while the object arrives
            try:
                index.fetch(np.arange(len(index.names)))  # everything, CRCs of STORED entries checked
                index.check_all()  # every local header
            finally:
                obj.progress = None
        compressed = np.nonzero(index.table["method"] != records.STORED)[0].tolist()
        with _progress(int(index.table["csize"][compressed].sum()), "verify", enabled=progress) as bar:
            verify_compressed(index, compressed, bar)  # checks the CRCs, in bounded memory
        levels = leaves = 0
        stack: list[Archive] = [ar]
        while stack:
            node = stack.pop()
            levels += 1
            for spec in node._level()[1].values():
                if spec.kind == "leaf":
                    leaves += 1
                    ar.source.check_leaf(spec.leaf)  # type: ignore[attr-defined]  # a remote .tdz: TdzSource
                elif spec.kind == "level":
                    stack.append(node._sub(spec.path))
        digests = 0
        if deep:
            from ..archive.verify_deep import check_digests

            with _progress(int(index.table["size"].sum()), "verify digests", enabled=progress) as bar:
                digests = check_digests(index, bar)
        return VerifyReport(
            index.path, len(index.names), levels, leaves, int(index.table["size"].sum()), digests=digests
        )
    finally:
        ar.close()


def is_archive_remote(target: Any, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the remote object is a zip with a top-level ``meta.json`` (tail + meta.json read)."""
    from .foreign import is_zip, start

    try:
        obj = RemoteObject(target, storage_options)
        start(obj, TAIL_BYTES)
        if not is_zip(obj, TAIL_BYTES) or "meta.json" not in RemoteIndex(obj):  # another format
            return False
        ar = open_remote(obj)
    except (TdzError, OSError):
        return False
    try:
        return ar.format == "tdz" and isinstance(ar.meta, dict)
    except (TdzError, OSError, ValueError):
        return False
    finally:
        ar.close()
