"""Opening a file of any format as an :class:`~tdz_numba.Archive`: format detection, the
``.tdz`` reader or a :mod:`tdz_numba.formats` reader, and the ``open``/``load`` options.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.archive.opening import open_archive
>>> from tdz_numba.archive.options import open_options
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.arange(3)}, pathlib.Path(d) / "x.tdz")
...     with open_archive(p, open_options(dtype=torch.float64)) as ar:
...         print(ar.format, ar["a"].dtype)
tdz torch.int64
"""

from __future__ import annotations

import os
from builtins import open as builtins_open
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from .. import formats
from ..errors import InternalError, MissingKeyError, TdzError, UnsupportedError
from ..files.loadadvice import whole_file_mappings
from ..files.memory import readahead, readahead_on
from ..tdz.plainlevel import advise_views
from ..tdz.source import TdzSource, open_tdz
from ..tdz.sources import Source, paused_gc
from ..tdz.tree import Level
from ..zipfmt.records import STORED
from .mapping import Archive
from .options import DEFAULT, OpenOptions
from .state import ArchiveState, subpath_prefix

if TYPE_CHECKING:  # pragma: no cover
    from .mapping import Archive

__all__ = ["open_archive", "load", "read_ahead_tdz"]


def open_archive(path: str | os.PathLike, options: OpenOptions = DEFAULT, *, whole: bool = False) -> Archive:
    """Opens a local file lazily with checked ``options`` (:func:`~tdz_numba.archive.options.open_options`);
    see :func:`tdz_numba.open`. ``whole``: the caller reads every level (:func:`load`); a ``.tdz``
    source then makes what that reads while it checks each level (``TdzSource.keep_plain``)."""
    mode, subpath, allow_pickle, num_threads, copy, device, dtype, direct, allow_external = options[:9]
    with paused_gc():  # a header of 20,000+ entries is thousands of containers (see load)
        source = _open_source(path, mode, allow_pickle, num_threads, copy, allow_external)
        if whole and type(source) is TdzSource:
            source.keep_plain = True
        state = ArchiveState(source, copy=copy, device=device, dtype=dtype)
        state.direct = bool(direct)
        state.aligned = bool(options.aligned)
        state.dequantize = bool(options.dequantize)
        try:
            if subpath is None:
                return Archive(state, "")
            if source.format == "tdz":
                prefix = subpath_prefix(subpath)
                if prefix and not source.has_level(prefix):
                    raise MissingKeyError(
                        f"{path}: no level at subpath {subpath!r} (no entry {prefix + 'meta.json'!r})"
                    )
                return Archive(state, prefix)
            root = Archive(state, "")
            if subpath_prefix(subpath) == "":
                return root
            return root.sublevel(subpath)
        except BaseException:
            source.close()
            raise


def _open_source(
    path: str | os.PathLike,
    mode: str,
    allow_pickle: bool,
    num_threads: int | None,
    copy: bool,
    allow_external: bool = False,
) -> Source:
    """The source of ``path``, one way: :func:`~tdz_numba.formats.detect.sniff` reads its first bytes
    once and names the format (a zip's index parsed on the way), then one reader takes the file (a
    ``.tdz`` archive keeps the index the detection parsed)."""
    try:
        name, ctx = formats.sniff(path)
    except UnsupportedError:
        if Path(path).suffix == ".tdz" or _plain_zip(path):  # the zip reader says what is wrong
            return open_tdz(path, mode=mode, allow_pickle=allow_pickle, num_threads=num_threads)
        raise
    if name == "tdz":
        if mode == "r" and ctx is not None:
            return TdzSource(path, allow_pickle=allow_pickle, num_threads=num_threads, index=ctx)
        if ctx is not None:
            ctx.close()
        return open_tdz(path, mode=mode, allow_pickle=allow_pickle, num_threads=num_threads)
    if mode != "r":
        if ctx is not None:
            ctx.close()
        raise UnsupportedError(
            f"{path}: mode={mode!r} is for .tdz archives; a {name} file opens with mode='r'"
        )
    extra = {"allow_external": True} if allow_external else {}  # (readers of one file ignore it)
    source = formats.open_source(path, copy=copy, sniffed=(name, ctx), **extra)  # reuses the parsed zip index
    if source is None:  # pragma: no cover - open_source returns None only for "tdz", handled above
        raise InternalError(f"{path}: detected as {name!r} but no reader opened it")
    return source


def _plain_zip(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a zip archive of other files (not a TorchScript archive)."""
    from ..zipfmt.index import ArchiveIndex

    if not os.path.isfile(path):  # a FIFO or a device is never opened here
        return False
    try:
        with builtins_open(path, "rb") as fh:
            if fh.read(4) != b"PK\x03\x04":
                return False
        index = ArchiveIndex(path)
    except (OSError, TdzError):
        return False
    try:
        return not any(n.endswith("/constants.pkl") or "/code/" in n for n in index.names)
    finally:
        index.close()


def load(path: str | os.PathLike, options: OpenOptions = DEFAULT, *, nest: str | None = None) -> Level:
    """Loads a local file as nested dicts; see :func:`tdz_numba.load`.

    Views of a whole file opened ``mode="r"`` are read through mappings advised for reading
    the whole file (:func:`~tdz_numba.files.loadadvice.whole_file_mappings`: the page cache fills
    with 2 MiB folios, whatever order the tensors are first touched in), and, with
    ``TDZ_NUMBA_READAHEAD=1``, their bytes are read ahead in file order in the background
    (:func:`~tdz_numba.files.memory.readahead`; the load returns at once). ``copy=True`` copies
    from the mapping with a parallel kernel (:mod:`tdz_numba.files.copying`, which advises its own
    mappings), or with ``preadv`` before Numba is in use; ``mode="r+"`` maps shared and a
    ``subpath`` reads a part: none of these is advised or read ahead here."""
    whole = options.mode == "r" and not options.copy and options.subpath is None
    # no cycles among the headers' containers and the leaves made here: the collector's passes
    # over a heap holding torch (125-150 ms each) would cost a 20,000-leaf .tdz load 1-2x its work
    with whole_file_mappings() if whole else nullcontext(), paused_gc():
        ar = open_archive(path, options, whole=True)
        try:
            tree = ar.to_dict(nest=nest)
            source = ar._state.source
            if whole and isinstance(source, TdzSource):  # (other formats: foreign.spec_tensors)
                advise_views(source)
                if options.dtype is None and options.device is None:
                    read_ahead_tdz(source)
            return tree
        finally:
            ar.close()


def read_ahead_tdz(source: Source) -> int:
    """Reads every STORED payload of a local ``.tdz`` source opened ``mode="r"`` ahead, in file
    order, in the background (:func:`~tdz_numba.files.memory.readahead`); the bytes it covers
    (0 for any other source). Payloads whose local header is still unread are left out.

    >>> import tempfile, pathlib, torch, tdz_numba
    >>> from tdz_numba.files.memory import wait_readahead
    >>> os.environ["TDZ_NUMBA_READAHEAD"] = "1"  # (off by default)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = tdz_numba.save({"a": torch.zeros(1 << 19)}, pathlib.Path(d) / "x.tdz")
    ...     src = open_tdz(p)
    ...     src.index.check_all()  # (a load has read every local header: payload offsets known)
    ...     n = read_ahead_tdz(src); _ = wait_readahead(); src.close()
    >>> del os.environ["TDZ_NUMBA_READAHEAD"]
    >>> n >= 2 << 20
    True
    """
    if not isinstance(source, TdzSource) or not readahead_on():  # (off by default: no ranges gathered)
        return 0
    index = getattr(source, "index", None)
    if source.mode != "r" or getattr(index, "fetch", None) is not None:
        return 0
    buf = index.buffer  # type: ignore[union-attr]
    if buf is None or not buf.size:
        return 0
    table = index.table  # type: ignore[union-attr]
    stored = table["method"] == STORED
    return readahead(buf, table["payload_offset"][stored], table["size"][stored])
