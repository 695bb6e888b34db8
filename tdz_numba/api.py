"""The read face of tdz_numba (re-exported by the package): open, load, is_archive, verify,
refresh_checksums. The write face is :mod:`tdz_numba.saving`, conversions :mod:`tdz_numba.conversion`.

Examples
--------
>>> import tempfile, pathlib, torch, numpy as np, tdz_numba
>>> tree = {"obs": {"pixels": torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
...                 "depth": np.ones((4, 8, 8), np.float32)},
...         "reward": torch.randn(4), "env": "cartpole"}
>>> with tempfile.TemporaryDirectory() as d:
...     path = tdz_numba.save(tree, pathlib.Path(d) / "buffer.tdz")
...     back = tdz_numba.load(path)
...     print(back["env"], back["obs"]["depth"].dtype, tdz_numba.is_archive(path))
cartpole torch.float32 True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .archive import opening as _opening
from .archive import verify as _integrity
from .archive.mapping import Archive
from .archive.options import DEFAULT, OpenOptions, load_keys, open_options
from .errors import MissingKeyError
from .files.paths import as_local_path, user_errors
from .remote import archive as _remote_archive
from .remote import read as _remote
from .tdz.tree import Level
from .zipfmt import checksums

__all__ = ["open", "load", "is_archive", "verify", "refresh_checksums", "PathLike"]

PathLike = str | os.PathLike


def open(
    path: PathLike,
    *,
    mode: str = "r",
    subpath: str | tuple[str, ...] | None = None,
    allow_pickle: bool = False,
    num_threads: int | None = None,
    copy: bool = False,
    device: Any = None,
    dtype: Any = None,
    storage_options: dict[str, Any] | None = None,
    direct: bool = False,
    allow_external: bool = False,
    map_location: Any = None,
    aligned: bool = False,
    dequantize: bool = False,
) -> Archive:
    """Opens a tensor file lazily as a read-only :class:`~tdz_numba.Archive` mapping.

    The format is detected from the file's bytes: ``.tdz`` archives, and,
    through :mod:`tdz_numba.formats`, safetensors (also sharded through their
    ``*.index.json``), torch ``.pt`` (without unpickling), ``.npy``/``.npz``,
    GGUF, HDF5, ONNX and tensordict memmap directories. ``ar.format`` names it.

    Parameters
    ----------
    path : str or os.PathLike
        The file (or memmap directory, or safetensors index), or an fsspec URL
        (``s3://``, ``gs://``, ``https://``, ``memory://``, ``simplecache::...``)
        or a seekable binary file object, of any format. Remote files are read
        with ranged requests: the header (or a zip's tail and index) at open,
        leaves on access; ``to_dict`` fetches a level's leaves in one coalesced
        concurrent batch. The object is pinned (ETag) at open: a replaced object
        raises :class:`~tdz_numba.RemoteError`. A ``.tdz``'s fetched entries are
        CRC-checked. See ``docs/remote.md`` for the requests each format costs.
    mode : {"r", "r+"}
        ``"r"`` maps the file privately: leaves are writable but writes stay
        in memory. ``"r+"`` maps it shared: in-place writes reach the file
        (then call :func:`refresh_checksums`); leaves that cannot be written
        through (compressed, unaligned, nested) raise
        :class:`~tdz_numba.UnsupportedError` when accessed.
    subpath : str or tuple of str, optional
        Open only the level at ``"a/b"`` or ``("a", "b")``; nothing outside
        it is parsed.
    allow_pickle : bool
        Unpickle ``other.pickle`` / ``pickle.pkl`` data (only for trusted
        files). Otherwise it comes back as :class:`~tdz_numba.PickledData`.
    num_threads : int, optional
        Threads that inflate compressed leaves (None: all cores, 1: serial).
        Nothing is inflated before a leaf (or, with ``to_dict``, its level)
        is accessed; every inflated entry's CRC-32 is checked.
    storage_options : dict, optional
        Options of the fsspec filesystem of a URL (endpoint, credentials, ...).
    copy : bool
        Leaves are owned tensors (read with parallel ``preadv`` by
        ``to_dict``/:func:`load`) instead of views of the file's mapping.
    direct : bool
        With ``copy=True``: page-aligned leaves (``save(..., align="auto")`` or a
        page ``align``) are read with ``O_DIRECT`` into page-aligned buffers,
        bypassing the page cache (nothing of the file stays cached); other leaves,
        and file systems that refuse ``O_DIRECT``, use buffered reads.
    aligned : bool
        Leaves whose file offset is not a multiple of their element size (every npz member,
        ONNX ``raw_data``, many HDF5 and some safetensors tensors) are views of the mapping at
        that unaligned address by default (CPU kernels read them correctly); ``aligned=True``
        copies exactly those leaves into aligned memory, for code that needs it
        (``info(k).aligned`` tells which they are).
    dequantize : bool
        GGUF: leaves of GGML quantized blocks (``Q4_0``, ``Q8_0``, ``Q4_K``, ...) come back
        decoded to float32 (as :meth:`Archive.dequantize` gives them) instead of as uint8
        block views; other leaves are unchanged.
    allow_external : bool
        HDF5 only: read virtual datasets, external raw storage and external links, from regular
        files inside the input's own folder (never through a symlink that leaves it); refused
        by default. See ``docs/formats.md``.
    device : str or torch.device, optional
        Where leaves go: ``"cpu"``, ``"cuda"`` (through pinned staging memory),
        ``"meta"`` (dtype and shape only: no payload is read), ...
    map_location : str or torch.device, optional
        ``torch.load``'s name for ``device`` (give one of the two).
    dtype : torch.dtype or str, optional
        Floating-point (and complex) leaves are cast to it on access (a name
        such as ``"float16"`` is accepted).

    Returns
    -------
    Archive

    Raises
    ------
    BadArchiveError
        Not a readable file of any supported format, or a malformed one.
    MissingKeyError
        ``subpath`` names no level.
    InvalidArgumentError
        A bad ``mode``, ``num_threads``, ``device`` or ``dtype``; ``subpath``
        naming a leaf rather than a level.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": {"b": torch.arange(3)}}, pathlib.Path(d) / "x.tdz")
    ...     with tdz_numba.open(p, subpath="a") as ar:
    ...         print(list(ar), ar["b"].tolist())
    ['b'] [0, 1, 2]
    """
    options = _options(
        mode,
        subpath,
        allow_pickle,
        num_threads,
        copy,
        device,
        dtype,
        direct,
        allow_external,
        map_location,
        aligned,
        dequantize,
    )
    if options.subpath is None:  # (what _open adds is for a subpath)
        return _open_checked(path, options, storage_options)
    return _open(path, options, storage_options)


def _options(
    mode: str,
    subpath: str | tuple[str, ...] | None,
    allow_pickle: bool,
    num_threads: int | None,
    copy: bool,
    device: Any,
    dtype: Any,
    direct: bool,
    allow_external: bool,
    map_location: Any,
    aligned: bool,
    dequantize: bool,
) -> OpenOptions:
    """The checked options of :func:`open`/:func:`load`: :data:`DEFAULT` when every keyword is
    exactly its default (False, not another false value: the 12-keyword check spared), else
    :func:`~tdz_numba.archive.options.open_options`."""
    if (
        mode == "r"
        and subpath is None
        and allow_pickle is False
        and num_threads is None
        and copy is False
        and device is None
        and dtype is None
        and direct is False
        and allow_external is False
        and map_location is None
        and aligned is False
        and dequantize is False
    ):
        return DEFAULT
    return open_options(
        mode=mode,
        subpath=subpath,
        allow_pickle=allow_pickle,
        num_threads=num_threads,
        copy=copy,
        device=device,
        dtype=dtype,
        direct=direct,
        allow_external=allow_external,
        map_location=map_location,
        aligned=aligned,
        dequantize=dequantize,
    )


def _open(path: PathLike, options: OpenOptions, storage_options: dict[str, Any] | None) -> Archive:
    """:func:`open` with checked options (a ``subpath`` that names a leaf: a clear error)."""
    try:
        return _open_checked(path, options, storage_options)
    except (KeyError, ValueError) as exc:  # MissingKeyError, BadArchiveError, InvalidArgumentError
        if options.subpath is None:
            raise
        leaf = _subpath_leaf(path, options, storage_options)
        if leaf is None:
            raise
        raise MissingKeyError(  # (no level there: a KeyError, as for a missing subpath)
            f"{path}: subpath {leaf!r} names a tensor leaf, not a level; "
            f"use load(path, keys=[{leaf!r}]) or open(path)[{leaf!r}]"
        ) from exc


def _subpath_leaf(path: PathLike, options: OpenOptions, storage_options: dict[str, Any] | None) -> str | None:
    """The subpath as a key when it names a leaf of the file (asked after a failed open)."""
    sub = options.subpath
    key = sub if isinstance(sub, str) else tuple(sub) if isinstance(sub, (tuple, list)) else None
    if key is None:
        return None
    try:
        root = _open_checked(path, options._replace(subpath=None), storage_options)
    except Exception:  # the first error stands
        return None
    try:
        node, spec = root._resolve(key)
        if spec.kind == "leaf":
            return key if isinstance(key, str) else "/".join(key)
        return None
    except Exception:  # noqa: BLE001 - not a leaf either: the first error stands
        return None
    finally:
        root.close()


def _open_checked(path: PathLike, options: OpenOptions, storage_options: dict[str, Any] | None) -> Archive:
    local = None
    if storage_options is None:
        local = path if isinstance(path, Path) else _plain_local_path(path)
    if local is None:
        if storage_options is not None or _remote.is_remote(path):  # fsspec URL or file object: ranged reads
            return _remote_archive.open_remote(path, options, storage_options=storage_options)
    try:  # (not `with user_errors(path)`: its cost, ~25 us of a cold open, is paid on errors only)
        return _opening.open_archive(local if local is not None else as_local_path(path), options)
    except OSError:
        with user_errors(path):  # the built-in OS error re-raised as the TdzError naming the path
            raise
        raise  # pragma: no cover - user_errors re-raises what it does not translate


def _plain_local_path(path: Any) -> Path | None:
    """``path`` as a :class:`~pathlib.Path` when it can only name a local file: a ``Path``
    (never a URL: it collapses ``//``) or a ``str`` without ``:`` (no URL scheme, no fsspec
    chain); None otherwise (:func:`~tdz_numba.remote.read.is_remote` and
    :func:`~tdz_numba.files.paths.as_local_path` decide)."""
    if isinstance(path, Path):
        return path
    if type(path) is str and ":" not in path:
        return Path(path)
    return None


def load(
    path: PathLike,
    *,
    subpath: str | tuple[str, ...] | None = None,
    mode: str = "r",
    allow_pickle: bool = False,
    num_threads: int | None = None,
    copy: bool = False,
    device: Any = None,
    dtype: Any = None,
    nest: str | None = None,
    storage_options: dict[str, Any] | None = None,
    direct: bool = False,
    allow_external: bool = False,
    keys: Any = None,
    map_location: Any = None,
    aligned: bool = False,
    dequantize: bool = False,
) -> Level:
    """Loads a tensor file (any format :func:`open` reads) as nested dicts of tensors and plain values.

    The dicts are :class:`~tdz_numba.Level` objects that also carry each
    level's metadata; tensors are views into one mapping of the file (see
    :func:`open` for ``mode``, ``subpath``, ``allow_pickle``, ``num_threads``,
    ``copy``, ``direct``, ``device`` and ``dtype``). Every leaf is resolved in one bulk
    pass; compressed leaves are inflated together, in parallel. ``nest="."``
    splits flat names (``"model.layers.0.weight"``) into nested dicts. A load reads the whole
    file: views of a file whose leaves, in key order, lie in file order are read as they are
    touched (2 MiB at a fault); of a file that lists them out of order (HDF5's names, a
    tensordict ``.tdz`` saved in another key order) the load reads the file forward first
    (see :func:`tdz_numba.files.loadadvice.whole_file_mappings`). :func:`open` reads only what is used.

    Parameters
    ----------
    path : str or os.PathLike
        The file, memmap directory or safetensors index; also an fsspec URL or
        a file object, of any format (see :func:`open`).
    subpath : str or tuple of str, optional
        Load only the level at ``"a/b"`` or ``("a", "b")``.
    mode : {"r", "r+"}
        ``"r+"``: leaves are shared views, in-place writes reach the file.
    allow_pickle : bool
        Unpickle ``other.pickle`` / ``pickle.pkl`` data (trusted files only).
    num_threads : int, optional
        Threads that inflate compressed leaves (None: all cores).
    copy : bool
        Owned tensors, read with parallel ``preadv``, instead of views.
    device : str or torch.device, optional
        Where the leaves go (``"meta"``: shapes and dtypes only).
    map_location : str or torch.device, optional
        ``torch.load``'s name for ``device`` (give one of the two).
    dtype : torch.dtype or str, optional
        Floating-point (and complex) leaves are cast to it (``"float16"`` names one).
    nest : str, optional
        Split flat names on this separator into nested dicts.
    keys : list of str, optional
        Load only these leaves or levels (each a key of the root, as the file names it
        (``"0.weight"``), or a path ``"a/b"``); the others are not touched.
    direct : bool
        With ``copy=True``: page-aligned leaves read with ``O_DIRECT`` (see :func:`open`).
    allow_external : bool
        HDF5 files made of several files (see :func:`open`).
    aligned : bool
        Copy the leaves not aligned for their dtype instead of viewing them (see :func:`open`).
    dequantize : bool
        GGUF quantized leaves decoded to float32 (see :func:`open`).
    storage_options : dict, optional
        Options of the fsspec filesystem of a URL.

    Returns
    -------
    Level
        Nested dicts (with each level's ``meta``) of tensors and plain values.

    Raises
    ------
    BadArchiveError
        Not a readable file of any supported format, or a malformed one
        (:class:`~tdz_numba.ChecksumError` for a CRC mismatch of an inflated
        or remote entry).
    MissingKeyError
        ``subpath`` names no level (also a ``KeyError``).
    InvalidArgumentError
        A bad ``mode``, ``num_threads``, ``device``, ``dtype``, ``nest`` or ``keys``; a
        ``subpath`` that names a leaf.
    UnsupportedError
        A leaf this reader cannot produce (e.g. ``mode="r+"`` on a
        compressed leaf).
    RemoteError
        A URL's object could not be read (after retries) or changed since it was opened.
    FileMissingError, AccessDeniedError
        The file is missing or not readable, naming the user's path (also
        ``FileNotFoundError`` / ``PermissionError``).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"x": torch.ones(3), "tag": "run-1"}, pathlib.Path(d) / "x.tdz")
    ...     tree = tdz_numba.load(p)
    ...     print(isinstance(tree, dict), tree["tag"], tree["x"].tolist())
    True run-1 [1.0, 1.0, 1.0]
    """
    options = _options(
        mode,
        subpath,
        allow_pickle,
        num_threads,
        copy,
        device,
        dtype,
        direct,
        allow_external,
        map_location,
        aligned,
        dequantize,
    )
    keys = load_keys(keys) if keys is not None else None
    if keys is not None or options.subpath is not None:
        ar = _open(path, options, storage_options)
        try:
            with user_errors(path, action="load"):
                return ar.to_dict(nest=nest, keys=keys)
        finally:
            ar.close()
    local = _plain_local_path(path) if storage_options is None else None
    if local is None:
        if storage_options is not None or _remote.is_remote(path):
            return _remote_archive.load_remote(path, options, nest=nest, storage_options=storage_options)
        local = as_local_path(path)
    try:  # (not `with user_errors(...)`: paid on errors only, as in _open_checked)
        return _opening.load(local, options, nest=nest)
    except OSError:
        with user_errors(path, action="load"):  # the built-in OS error as the TdzError naming the path
            raise
        raise  # pragma: no cover - user_errors re-raises what it does not translate


def is_archive(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` is a file holding a zip archive with a top-level ``meta.json``.

    It answers as :func:`open` would: True only when the root ``meta.json``
    is a JSON object. It never raises for a missing, unreadable or malformed
    file (that is a False).

    Parameters
    ----------
    path : str or os.PathLike
        The file; also an fsspec URL.
    storage_options : dict, optional
        Options of the fsspec filesystem of a URL.

    Returns
    -------
    bool

    Raises
    ------
    InvalidArgumentError
        ``path`` is not a path, URL or file object (e.g. an int). Everything
        else, including an unreachable URL, answers False.

    Examples
    --------
    >>> import tdz_numba
    >>> tdz_numba.is_archive("/nonexistent.tdz")
    False
    """
    if storage_options is not None or _remote.is_remote(path):
        return _remote_archive.is_archive_remote(path, storage_options=storage_options)
    return _integrity.is_archive(as_local_path(path))


def verify(
    path: PathLike,
    *,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    deep: bool = False,
) -> _integrity.VerifyReport:
    """Checks every entry's CRC-32 (in parallel) and the archive's structure.

    Parameters
    ----------
    path : str or os.PathLike
        The archive (or another format :func:`open` reads); also an fsspec URL.
    progress : bool, optional
        A tqdm bar on stderr (None: only when stderr is a terminal), as for
        :func:`save`, :func:`pack` and :func:`unpack`.
    storage_options : dict, optional
        Options of the fsspec filesystem of a URL.
    deep : bool
        Also recompute every leaf's stored XXH3-128 digest (``save(..., digest=True)``);
        a mismatch raises :class:`ChecksumError` naming the leaf (a URL: from the bytes
        the CRC check fetched, no second download).

    Returns
    -------
    VerifyReport
        Counts of the entries and leaves checked (``digests``: those recomputed).

    Raises
    ------
    ChecksumError
        A CRC-32 mismatch, naming the first bad entry (after ``mode="r+"``
        writes: run :func:`refresh_checksums` / ``tdz refresh``).
    BadArchiveError
        A structural fault (headers, offsets, a leaf's size).
    FileMissingError, AccessDeniedError
        The file is missing or not readable, naming the user's path (also
        ``FileNotFoundError`` / ``PermissionError``).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": torch.ones(2)}, pathlib.Path(d) / "x.tdz")
    ...     print(tdz_numba.verify(p).leaves)
    1
    """
    if storage_options is not None or _remote.is_remote(path):
        return _remote_archive.verify_remote(
            path, storage_options=storage_options, progress=progress, deep=deep
        )
    with user_errors(path, action="verify"):
        return _integrity.verify(as_local_path(path), progress=progress, deep=deep)


def refresh_checksums(path: PathLike) -> Path:
    """Re-stamps the CRC-32 of every STORED entry after ``mode="r+"`` writes.

    Updates local headers (or data descriptors, in foreign zips) and central
    records in place, so that ``unzip -t`` and :func:`verify` pass again.

    Parameters
    ----------
    path : str or os.PathLike
        A local archive.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    BadArchiveError
        Not a readable archive, or a malformed one.
    UnsupportedError
        A URL or a file object.
    FileMissingError, AccessDeniedError
        The file is missing or not readable, naming the user's path (also
        ``FileNotFoundError`` / ``PermissionError``).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": torch.zeros(2)}, pathlib.Path(d) / "x.tdz")
    ...     with tdz_numba.open(p, mode="r+") as ar:
    ...         _ = ar["a"].add_(1)
    ...     _ = tdz_numba.refresh_checksums(p)
    ...     print(tdz_numba.verify(p).entries, tdz_numba.load(p)["a"].tolist())
    2 [1.0, 1.0]
    """
    with user_errors(path, action="update"):
        return checksums.refresh_checksums(as_local_path(path))
