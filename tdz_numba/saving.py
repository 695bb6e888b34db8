"""The write face of tdz_numba (re-exported by the package): save, pack, unpack, allocate, clean
(a model's state dict with tied weights: :mod:`tdz_numba.models`).

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"w": torch.ones(2, 3), "step": 7}, pathlib.Path(d) / "ckpt.tdz")
...     print(p.name, tdz_numba.load(p)["step"])
ckpt.tdz 7
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .archive import opening as _opening
from .archive.mapping import Archive
from .archive.options import OpenOptions
from .errors import FileMissingError, InvalidArgumentError
from .files.paths import as_local_path, user_errors
from .remote import read as _remote
from .tdz.gcpause import paused_gc
from .tdz.tdcompat import converter as tdcompat_converter
from .tdz.tree import flatten
from .zipfmt import writer as _writer

__all__ = ["save", "pack", "unpack", "allocate", "clean", "check_tdz_suffix"]

PathLike = str | os.PathLike


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
    digest: bool = False,
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
        writing the payloads (None: the calling thread writes while one more
        computes the CRC-32s a few MiB ahead of it, when the save has 4 MiB or
        more and the process may use 2 cores; 1: the calling thread alone, each
        piece hashed right after its write; 2 to 4: that many share the pieces,
        each hashing and writing its own). Deflate runs in parallel across entries and within large
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
    digest : bool
        Store an XXH3-128 digest of every payload (computed as it is written) in its
        central record, where zip tools and tensordict ignore it: ``info(k).digest``,
        ``verify(path, deep=True)``, :func:`tdz_numba.diff` without reading payloads.
        Needs the ``digest`` extra (the ``xxhash`` package); URLs and file objects too.

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
    check_tdz_suffix(path)
    if digest:
        from .zipfmt.digest import require

        require("save(digest=True)")
    with paused_gc():  # 20,000 leaves: as many entries and records, no cycles (a full pass: ~150 ms)
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
                digest=digest,
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
                digest=digest,
            )


#: Suffixes that name another format: :func:`save` (which writes ``.tdz``) refuses them.
FOREIGN_SUFFIXES = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".npz": "npz",
    ".npy": "npy",
    ".gguf": "GGUF",
    ".h5": "HDF5",
    ".hdf5": "HDF5",
    ".onnx": "ONNX",
}


def check_tdz_suffix(path: Any) -> None:
    """Raises :class:`~tdz_numba.InvalidArgumentError` when ``path``'s suffix names another
    format (``.safetensors``, ``.pt``, ``.npz``, ...): :func:`save` writes ``.tdz`` archives
    only, and a ``.tdz`` under such a name misleads the format's own tools."""
    if not isinstance(path, (str, os.PathLike)):
        return  # a file object: no name
    name = os.fspath(path)
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    suffix = os.path.splitext(name.rstrip("/"))[1].lower()
    fmt = FOREIGN_SUFFIXES.get(suffix)
    if fmt is not None:
        raise InvalidArgumentError(
            f"{name}: save writes .tdz archives, but the suffix {suffix!r} names a {fmt} file; "
            f"use a .tdz name (convert(src, 'x.safetensors') writes safetensors)"
        )


def _metadata_entry(metadata: Any) -> Any:
    import json

    from .errors import InvalidArgumentError
    from .tdz.source import METADATA_ENTRY
    from .zipfmt.entry import Entry

    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise InvalidArgumentError(f"metadata must be a dict with str keys, got {type(metadata).__name__}")
    try:
        data = json.dumps(metadata, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metadata must hold JSON values: {exc}") from None
    return Entry(METADATA_ENTRY, data=data)


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
        Threads for compression and for hashing and writing the payloads, as
        for :func:`save` (None: deflate on all cores; the calling thread writes
        while one more computes the CRC-32s ahead of it).
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
    _writer.check_write_args(compression, compresslevel, num_threads)
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


def allocate(
    template: Any,
    path: PathLike,
    *,
    existsok: bool = True,
    durable: bool = True,
    reserve: bool = True,
    align: int | str | None = None,
    align_threshold: int | None = None,
) -> Archive:
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
        return _opening.open_archive(target, OpenOptions(mode="r+"))


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
    ...     print(tdz_numba.clean(d))
    []
    """
    from .files import tempfiles as _tempfiles

    with user_errors(directory, action="clean"):
        return _tempfiles.clean(as_local_path(directory, what="directory"), dry_run=dry_run)
