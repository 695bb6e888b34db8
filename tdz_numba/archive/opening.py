"""Opening a file of any format as an :class:`~tdz_numba.Archive`: format detection, the
``.tdz`` reader or a :mod:`tdz_numba.formats` reader, and the ``open``/``load`` options.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.archive.opening import open_archive
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.arange(3)}, pathlib.Path(d) / "x.tdz")
...     with open_archive(p, dtype=torch.float64) as ar:
...         print(ar.format, ar["a"].dtype)
tdz torch.int64
"""

from __future__ import annotations

import os
from builtins import open as builtins_open
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import formats
from ..errors import InternalError, InvalidArgumentError, MissingKeyError, TdzError, UnsupportedError
from ..tdz.source import TdzSource, open_tdz
from ..tdz.sources import Source
from ..tdz.tree import Level
from .mapping import Archive, _State, subpath_prefix

if TYPE_CHECKING:  # pragma: no cover
    from .mapping import Archive

__all__ = ["open_archive", "load"]

def open_archive(
    path: str | os.PathLike,
    *,
    mode: str = "r",
    subpath: str | tuple[str, ...] | None = None,
    allow_pickle: bool = False,
    num_threads: int | None = None,
    copy: bool = False,
    device: Any = None,
    dtype: Any = None,
    direct: bool = False,
) -> Archive:
    """Opens a file lazily; see :func:`tdz_numba.open`."""
    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    if num_threads is not None:
        from ..jit.presets import check_num_threads

        num_threads = check_num_threads(num_threads)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(f"device: {exc}") from None
    source = _open_source(path, mode=mode, allow_pickle=allow_pickle, num_threads=num_threads, copy=copy)
    fmt = source.format
    state = _State(source, copy=copy, device=device, dtype=dtype)
    state.direct = bool(direct)
    try:
        if subpath is None:
            return Archive(state, "")
        if fmt == "tdz":
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
    path: str | os.PathLike, *, mode: str, allow_pickle: bool, num_threads: int | None, copy: bool
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
        raise UnsupportedError(f"{path}: mode={mode!r} is for .tdz archives; a {name} file opens with mode='r'")
    source = formats.open_source(path, copy=copy, sniffed=(name, ctx))  # reuses the parsed zip index
    if source is None:  # pragma: no cover - open_source returns None only for "tdz", handled above
        raise InternalError(f"{path}: detected as {name!r} but no reader opened it")
    return source


def _plain_zip(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a zip archive of other files (not a TorchScript archive)."""
    from ..zipfmt.index import ArchiveIndex

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


def load(
    path: str | os.PathLike,
    *,
    subpath: str | tuple[str, ...] | None = None,
    mode: str = "r",
    allow_pickle: bool = False,
    num_threads: int | None = None,
    copy: bool = False,
    device: Any = None,
    dtype: Any = None,
    nest: str | None = None,
    direct: bool = False,
) -> Level:
    """Loads a file as nested dicts; see :func:`tdz_numba.load`."""
    ar = open_archive(
        path,
        mode=mode,
        subpath=subpath,
        allow_pickle=allow_pickle,
        num_threads=num_threads,
        copy=copy,
        device=device,
        dtype=dtype,
        direct=direct,
    )
    try:
        return ar.to_dict(nest=nest)
    finally:
        ar.close()
