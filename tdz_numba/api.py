"""The public functions of tdz_numba (re-exported by the package).

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

from .archive import mapping as _archive
from .archive import verify as _integrity
from .errors import FileMissingError
from .files.paths import as_local_path, user_errors
from .remote import read as _remote
from .tdz.tdcompat import converter as tdcompat_converter
from .tdz.tree import Level, flatten
from .zipfmt import writer as _writer

__all__ = [
    "save",
    "open",
    "load",
    "pack",
    "unpack",
    "is_archive",
    "verify",
    "refresh_checksums",
    "allocate",
    "clean",
    "convert",
]

PathLike = str | os.PathLike


def _check_num_threads(num_threads: object) -> None:
    if num_threads is None:  # nothing to check (importing from _jit runs its module __getattr__)
        return
    from .jit.presets import check_num_threads  # numba loads with the first kernel anyway

    check_num_threads(num_threads)


def save(
    tree: Any,
    path: PathLike,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    existsok: bool = True,
    num_threads: int | None = None,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    durable: bool = True,
    align: int | str | None = None,
    align_threshold: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Saves a tree of tensors as a ``.tdz`` archive.

    Parameters
    ----------
    tree : Mapping or tensordict.TensorDict
        Nested mappings of ``torch.Tensor`` / ``numpy.ndarray`` leaves and
        plain values (str, int, float, bool, None and lists of them, written
        as tensordict NonTensorData levels). :class:`~tdz_numba.tdz.tree.Level`
        objects from :func:`load` keep their batch size, names and class.
        A ``tensordict.TensorDict`` is accepted when tensordict is installed.
    path : str or os.PathLike
        The archive to write. It is written to a temporary file beside it and
        then renamed, so an existing file is replaced atomically (its
        permissions kept) and left intact on error.
        An fsspec URL (``s3://bucket/x.tdz``, ``memory://x.tdz``, ...) or a
        writable file object is streamed in one sequential pass, without a
        local file; the object appears only when complete (a multipart upload
        is aborted on error, an existing object is left intact).
    compression : {None, "stored", "deflate", "bzip2", "lzma"}
        Compression of ``*.memmap`` payloads; ``meta.json`` files are always
        stored. Compressed leaves are decompressed on load (no zero-copy).
    compresslevel : int, optional
        Level passed to the codec.
    existsok : bool
        When False, an existing file raises :class:`~tdz_numba.ArchiveExistsError`.
    num_threads : int, optional
        Threads for deflate (None: all cores, 1: serial) and for hashing and
        writing the payloads (None: the calling thread, which hashes each piece
        right after writing it, while it is in cache; 2 to 4: that many share
        the pieces). Deflate runs in parallel across entries and within large
        ones: each entry is cut into independent 4 MiB segments, full-flushed,
        so that the entry is still one standard raw-deflate stream.
    progress : bool, optional
        A tqdm progress bar on stderr (None: only when stderr is a terminal).
    storage_options : dict, optional
        Options of the fsspec filesystem of a URL (endpoint, credentials, ...).
    align : {None, 64, 4096, 16384, 65536, "auto"}
        Payload alignment: ``None``/``64`` every stored leaf on a 64-byte
        boundary (tensordict's bytes, the default); a page size: every stored
        leaf on that boundary; ``"auto"``: leaves of at least
        ``align_threshold`` bytes (default 1 MiB) on a 64 KiB boundary, the
        rest at 64 bytes: big leaves page-aligned (mapped and evicted one by
        one, :meth:`Archive.evict`) at a file size within a few per mille of
        the payload. Every variant is a standard zip that tensordict reads.
    align_threshold : int, optional
        The size threshold of ``align="auto"``, in bytes.
    durable : bool
        ``fsync`` the file before renaming it into place and the directory
        after, so that a power loss leaves the old archive or the new one
        (default; the device writes start while the file is written, so the
        ``fsync`` waits for the last few MiB and the device's own speed:
        measured on a virtual disk, 64 MiB +15-35 ms, 256 MiB +50-90 ms).
        ``False`` skips both, as ``torch.save`` and safetensors' ``save_file``
        do: after a crash the file may be renamed yet empty. The temporary file
        is named ``.{name}.tdz-tmp.{host}.{pid}.{random}``; those of killed
        saves are removed by the next save in the directory (or
        :func:`clean`).
    metadata : dict, optional
        The file's own metadata (str keys, JSON-able values), returned by
        ``Archive.metadata``. It is stored in a top-level ``__metadata__.json``
        entry that tensordict's ``load_memmap`` ignores.

    Returns
    -------
    pathlib.Path
        The path written (symlinks resolved).

    Raises
    ------
    InvalidTreeError
        A value that cannot be written.
    ArchiveExistsError
        ``existsok=False`` and the file exists, or ``path`` is a directory.
    AccessDeniedError
        The file or its directory is not writable (also a ``PermissionError``).
    DiskFullError
        No space left (also an ``OSError``); the old file, if any, is intact.
    InvalidArgumentError
        ``metadata`` is not a dict of str to JSON-able values.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"w": torch.ones(2, 2)}, pathlib.Path(d) / "ckpt.tdz")
    ...     print(p.suffix, tdz_numba.load(p)["w"].sum().item())
    .tdz 4.0
    """
    _writer.check_write_args(compression, compresslevel, num_threads)
    if storage_options is not None or _remote.is_remote(path):  # fsspec URL or file object: streamed
        from .remote.write import save_remote

        entries = flatten(tree, convert=tdcompat_converter())
        if metadata is not None:
            entries.append(_metadata_entry(metadata))
        return save_remote(
            entries,
            path,
            storage_options=storage_options,
            existsok=existsok,  # type: ignore[return-value]
            compression=compression,
            compresslevel=compresslevel,
            num_threads=num_threads,
        )
    with user_errors(path, action="write"):
        target = _writer.check_target(path, existsok)
        entries = flatten(tree, convert=tdcompat_converter())
        if metadata is not None:
            entries.append(_metadata_entry(metadata))
        return _writer.write_entries(
            entries,
            target,
            compression=compression,
            compresslevel=compresslevel,
            num_threads=num_threads,
            progress=progress,
            durable=durable,
            align=align,
            align_threshold=align_threshold,
        )


def _metadata_entry(metadata: Any) -> Any:
    import json

    from .errors import InvalidArgumentError
    from .tdz.source import METADATA_ENTRY
    from .tdz.tree import Entry

    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise InvalidArgumentError(f"metadata must be a dict with str keys, got {type(metadata).__name__}")
    try:
        data = json.dumps(metadata, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metadata must hold JSON values: {exc}") from None
    return Entry(METADATA_ENTRY, data=data)


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
) -> _archive.Archive:
    """Opens a tensor file lazily as a read-only :class:`~tdz_numba.Archive` mapping.

    The format is detected from the file's bytes: ``.tdz`` archives, and,
    through :mod:`tdz_numba.formats`, safetensors (also sharded through their
    ``*.index.json``), torch ``.pt`` (without unpickling), ``.npy``/``.npz``,
    GGUF, HDF5, ONNX and tensordict memmap directories. ``ar.format`` names it.

    Parameters
    ----------
    path : str or os.PathLike
        The file (or memmap directory, or safetensors index); for ``.tdz``
        archives also an fsspec URL (``s3://``, ``gs://``, ``https://``,
        ``memory://``, ...) or a seekable binary file object.
        Remote archives are read with ranged requests: the tail at open, each
        level's meta.json when reached, leaves on access; ``to_dict`` fetches
        a level's entries in one coalesced concurrent batch. Every fetched
        entry's CRC-32 is checked.
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
    device : str or torch.device, optional
        Where leaves go: ``"cpu"``, ``"cuda"`` (through pinned staging memory),
        ``"meta"`` (dtype and shape only: no payload is read), ...
    dtype : torch.dtype, optional
        Floating-point (and complex) leaves are cast to it on access.

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
        A bad ``mode``, ``num_threads``, ``device`` or ``dtype``.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": {"b": torch.arange(3)}}, pathlib.Path(d) / "x.tdz")
    ...     with tdz_numba.open(p, subpath="a") as ar:
    ...         print(list(ar), ar["b"].tolist())
    ['b'] [0, 1, 2]
    """
    if num_threads is not None:
        _check_num_threads(num_threads)
    local = _plain_local_path(path) if storage_options is None else None
    if local is None:
        if storage_options is not None or _remote.is_remote(path):  # fsspec URL or file object: ranged reads
            return _remote.open_remote(
                path,
                mode=mode,
                subpath=subpath,
                allow_pickle=allow_pickle,
                num_threads=num_threads,
                storage_options=storage_options,
            )
    try:  # (not `with user_errors(path)`: its cost, ~25 us of a cold open, is paid on errors only)
        return _archive.open_archive(
            local if local is not None else as_local_path(path),
            mode=mode,
            subpath=subpath,
            allow_pickle=allow_pickle,
            num_threads=num_threads,
            copy=copy,
            device=device,
            dtype=dtype,
            direct=direct,
        )
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
) -> Level:
    """Loads a tensor file (any format :func:`open` reads) as nested dicts of tensors and plain values.

    The dicts are :class:`~tdz_numba.Level` objects that also carry each
    level's metadata; tensors are views into one mapping of the file (see
    :func:`open` for ``mode``, ``subpath``, ``allow_pickle``, ``num_threads``,
    ``copy``, ``direct``, ``device`` and ``dtype``). Every leaf is resolved in one bulk
    pass; compressed leaves are inflated together, in parallel. ``nest="."``
    splits flat names (``"model.layers.0.weight"``) into nested dicts.

    Parameters
    ----------
    path : str or os.PathLike
        The file, memmap directory or safetensors index; for ``.tdz`` archives
        also an fsspec URL (see :func:`open`).
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
    dtype : torch.dtype, optional
        Floating-point (and complex) leaves are cast to it.
    nest : str, optional
        Split flat names on this separator into nested dicts.
    direct : bool
        With ``copy=True``: page-aligned leaves read with ``O_DIRECT`` (see :func:`open`).
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
        A bad ``mode``, ``num_threads``, ``device``, ``dtype`` or ``nest``.
    UnsupportedError
        A leaf this reader cannot produce (e.g. ``mode="r+"`` on a
        compressed leaf), or a file object.
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
    _check_num_threads(num_threads)
    if storage_options is not None or _remote.is_remote(path):
        return _remote.load_remote(
            path,
            subpath=subpath,
            mode=mode,
            allow_pickle=allow_pickle,
            num_threads=num_threads,
            storage_options=storage_options,
        )
    with user_errors(path, action="load"):
        return _archive.load(
            as_local_path(path),
            subpath=subpath,
            mode=mode,
            allow_pickle=allow_pickle,
            num_threads=num_threads,
            copy=copy,
            device=device,
            dtype=dtype,
            nest=nest,
            direct=direct,
        )


def pack(
    directory: PathLike,
    path: PathLike,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    num_threads: int | None = None,
    progress: bool | None = None,
    durable: bool = True,
    align: int | str | None = None,
    align_threshold: int | None = None,
) -> Path:
    """Packs a tensordict memmap directory into an archive (like ``zip -0 -r``, aligned).

    Parameters
    ----------
    directory : str or os.PathLike
        A tensordict memmap directory (what ``TensorDict.memmap`` writes).
    path : str or os.PathLike
        The archive to write (replaced atomically); also an fsspec URL.
    compression : {None, "deflate", "bzip2", "lzma"}, optional
        Codec of the payloads, as for :func:`save` (None: stored).
    compresslevel : int, optional
        Codec level, as for :func:`save`.
    num_threads : int, optional
        Threads for CRCs and compression (None: all cores).
    progress : bool, optional
        A tqdm progress bar on stderr (None: only when stderr is a terminal).
    durable : bool
        ``fsync`` the file and its directory before returning.
    align, align_threshold : optional
        Payload alignment, as for :func:`save`.

    Returns
    -------
    pathlib.Path
        The archive written.

    Raises
    ------
    FileMissingError
        ``directory`` does not exist (also a ``FileNotFoundError``).
    AccessDeniedError, DiskFullError
        The target is not writable, or the disk is full (also ``OSError``
        subclasses); an old archive at ``path`` stays intact.
    ArchiveExistsError
        ``path`` is a directory.
    InvalidArgumentError, UnknownCompressionError
        A bad ``num_threads``, ``align`` or ``compresslevel``; an unknown
        ``compression``.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     d = pathlib.Path(d)
    ...     _ = tdz_numba.save({"a": torch.ones(2)}, d / "x.tdz")
    ...     _ = tdz_numba.unpack(d / "x.tdz", d / "dir")
    ...     print(tdz_numba.load(tdz_numba.pack(d / "dir", d / "y.tdz"))["a"].tolist())
    [1.0, 1.0]
    """
    if _remote.is_remote(path):  # streamed to an fsspec URL, as save() does
        from .remote.write import save_remote

        source = as_local_path(directory, what="directory")
        if not source.is_dir():
            raise FileMissingError(f"{directory}: no such directory", path=directory)
        entries = _writer.directory_entries(source, Path(os.devnull))
        return save_remote(
            entries,
            path,
            compression=compression,
            compresslevel=compresslevel,  # type: ignore[return-value]
            num_threads=num_threads,
        )
    with user_errors(path, action="write"):
        target = _writer.check_target(path, True)
        with user_errors(directory, action="pack"):
            source = as_local_path(directory, what="directory")
            if not source.exists():
                raise FileNotFoundError(2, "no such directory", str(source))
            entries = _writer.directory_entries(source, target)
        return _writer.write_entries(
            entries,
            target,
            compression=compression,
            compresslevel=compresslevel,
            num_threads=num_threads,
            progress=progress,
            durable=durable,
            align=align,
            align_threshold=align_threshold,
        )


def unpack(path: PathLike, directory: PathLike, *, progress: bool | None = None) -> Path:
    """Extracts an archive into a memmap directory that tensordict's ``load_memmap``
    reads (like ``unzip``), safely.

    Every name is checked before anything is written (absolute, ``..``/``.``,
    empty or over-long components, ``a//b`` aliases, a name that is both a
    file and a directory, symbolic-link entries). The entries are written
    into a temporary directory beside ``directory``, relative to directory
    file descriptors with ``O_NOFOLLOW`` (no symbolic link is ever followed),
    compressed ones decoded through a fixed-size buffer, CRCs checked; then a
    missing or empty ``directory`` is replaced by it with one rename. An
    existing non-empty ``directory`` is merged into as tensordict's
    ``unpack_memmap`` does: the archive's files replace files of the same name
    (a link is replaced, not followed), other files stay. See
    :mod:`tdz_numba.zipfmt.extract`.

    Parameters
    ----------
    path : str or os.PathLike
        The archive.
    directory : str or os.PathLike
        The directory to create (or fill). Symbolic links in this path itself
        are followed, as ``cd`` would.
    progress : bool, optional
        A tqdm progress bar on stderr (None: only when stderr is a terminal).

    Returns
    -------
    pathlib.Path
        ``directory``.

    Raises
    ------
    BadArchiveError
        An unsafe or ambiguous name, a corrupt entry (:class:`ChecksumError`
        for a CRC mismatch): nothing is left behind.
    ArchiveExistsError
        ``directory`` is a file, or merging would need a directory of it
        replaced by a file (or a file or link by a directory).
    FileMissingError, AccessDeniedError, DiskFullError
        File-system errors, naming the user's path (also ``OSError`` subclasses).
    UnsupportedError
        A URL or a file object (not supported yet).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = tdz_numba.save({"a": torch.ones(2)}, pathlib.Path(d) / "x.tdz")
    ...     out = tdz_numba.unpack(pathlib.Path(d) / "x.tdz", pathlib.Path(d) / "dir")
    ...     print(sorted(p.name for p in out.iterdir()))
    ['a.memmap', 'meta.json']
    """
    from .zipfmt import extract

    return extract.unpack(as_local_path(path), as_local_path(directory, what="directory"), progress=progress)


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
        return _remote.is_archive_remote(path, storage_options=storage_options)
    return _integrity.is_archive(as_local_path(path))


def verify(
    path: PathLike, *, progress: bool | None = None, storage_options: dict[str, Any] | None = None
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

    Returns
    -------
    VerifyReport
        Counts of the entries and leaves checked.

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
        return _remote.verify_remote(path, storage_options=storage_options, progress=progress)
    with user_errors(path, action="verify"):
        return _integrity.verify(as_local_path(path), progress=progress)


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
        return _integrity.refresh_checksums(as_local_path(path))


def allocate(
    template: Any,
    path: PathLike,
    *,
    existsok: bool = True,
    durable: bool = True,
    reserve: bool = True,
    align: int | str | None = None,
    align_threshold: int | None = None,
) -> _archive.Archive:
    """Creates a zero-filled archive shaped like ``template``, open with ``mode="r+"``.

    Only shapes and dtypes of ``template`` are used: expanded (stride-0)
    tensors are not materialized, and payloads are never written (CRCs of the
    zeros are computed arithmetically). With ``reserve=True`` (default) the
    file's blocks are allocated without being written (Linux ``fallocate``,
    as ``posix_fallocate`` but never emulated by writing): a full disk raises
    :class:`~tdz_numba.DiskFullError` here (nothing left behind) instead of a
    SIGBUS on a later write through the mapping. ``reserve=False`` leaves the
    file sparse (no disk used until written; then a full disk kills the
    process with SIGBUS). This is tensordict's ``memmap_like`` to a ``.tdz``.

    Parameters
    ----------
    template : nested dicts, TensorDict or tensorclass
        The tree whose leaves' shapes and dtypes the archive gets (meta-device
        and expanded tensors are fine).
    path : str or os.PathLike
        The archive to create.
    existsok : bool
        Overwrite an existing file (False: raise :class:`ArchiveExistsError`).
    durable : bool
        ``fsync`` the file and its directory before returning.
    reserve : bool
        Allocate the file's blocks now (True) or leave it sparse (False).
    align, align_threshold : optional
        Payload alignment, as for :func:`save`.

    Returns
    -------
    Archive
        The new archive, open with ``mode="r+"``: write into its leaves, then
        ``close(refresh=True)`` (or :func:`refresh_checksums`).

    Raises
    ------
    InvalidTreeError
        A value of ``template`` that cannot be written.
    ArchiveExistsError
        ``existsok=False`` and the file exists, or ``path`` is a directory.
    AccessDeniedError, DiskFullError
        Not writable, or no space for the reserved blocks (also ``OSError``
        subclasses); nothing is left behind.
    InvalidArgumentError
        A bad ``align`` or ``align_threshold``.

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> frame = torch.zeros(84, 84, dtype=torch.uint8)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with tdz_numba.allocate({"obs": frame.expand(1000, 84, 84)},
    ...                             pathlib.Path(d) / "buf.tdz") as buf:
    ...         buf["obs"][3] = 7
    ...         print(buf["obs"].shape, int(buf["obs"].sum()))
    torch.Size([1000, 84, 84]) 49392
    """
    with user_errors(path, action="write"):
        target = _writer.check_target(path, existsok)
        _writer.write_entries(
            flatten(template, zeros=True, convert=tdcompat_converter()),
            target,
            durable=durable,
            reserve=reserve,
            align=align,
            align_threshold=align_threshold,
        )
        return _archive.open_archive(target, mode="r+")


def clean(directory: PathLike, *, dry_run: bool = False) -> list[Path]:
    """Removes the temporary files and directories that killed saves and unpacks left in
    ``directory`` (what ``tdz clean DIR`` does).

    Only names of the form ``.{name}.tdz-tmp.{host}.{pid}.{random}`` made on
    this host by a process that is no longer alive are removed; a save in
    progress is never disturbed. Every save does this for its own directory.

    Returns
    -------
    list of pathlib.Path
        What was removed (or would be, with ``dry_run=True``).

    Examples
    --------
    >>> import tempfile, tdz_numba
    >>> with tempfile.TemporaryDirectory() as d:
    ...     print(tdz_numba.api.clean(d))
    []
    """
    from .files import tempfiles as _tempfiles

    with user_errors(directory, action="clean"):
        return _tempfiles.clean(as_local_path(directory, what="directory"), dry_run=dry_run)


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    nest: str | None = ".",
    compression: str | None = None,
    progress: bool | None = None,
) -> Path:
    """Converts any readable tensor file to ``.tdz``, or a ``.tdz`` archive to ``.safetensors``.

    Parameters
    ----------
    src : str or os.PathLike
        A file :func:`open` reads (safetensors, ``.pt``, npz, GGUF, ``.tdz``, ...).
    dst : str or os.PathLike
        The file to write: a ``.safetensors`` name writes safetensors, anything
        else a ``.tdz`` archive (through the parallel writer; leaves go in as
        views of the source's mapping).
    nest : str or None
        To ``.tdz``: flat names are split on ``nest`` into levels (None: kept
        flat). To ``.safetensors``: nested keys are joined with it (default ".").
    compression : str, optional
        Codec of the ``.tdz`` payloads (as for :func:`save`).
    progress : bool, optional
        A progress bar on stderr.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    InvalidTreeError
        A leaf the target format cannot hold (e.g. complex dtypes in safetensors).

    Examples
    --------
    >>> import tempfile, pathlib, torch, tdz_numba
    >>> import json
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": {"b": torch.ones(2)}, "tag": "x"}, pathlib.Path(d) / "x.tdz")
    ...     st = tdz_numba.convert(p, pathlib.Path(d) / "x.safetensors")
    ...     raw = st.read_bytes()
    ...     header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    ...     print(header["a.b"]["shape"], header["__metadata__"])
    [2] {'tag': '"x"'}
    """
    from . import conversion as _convert

    return _convert.convert(src, dst, nest=nest, compression=compression, progress=progress)
