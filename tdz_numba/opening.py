"""Opening a file of any format as an :class:`~tdz_numba.Archive`: format detection, the
``.tdz`` reader or a :mod:`tdz_numba.formats` reader, and the ``open``/``load`` options.

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> from tdz_numba.opening import open_archive
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"a": torch.arange(3)}, pathlib.Path(d) / "x.tdz")
...     with open_archive(p, dtype=torch.float64) as ar:
...         print(ar.format, ar["a"].dtype)
tdz torch.int64
"""

from __future__ import annotations

import os
import sys
from builtins import open as builtins_open
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import formats as _formats  # noqa: F401 - imported here, looked up on the package per open
from .archive import Archive, _State, subpath_prefix
from .errors import InvalidArgumentError, MissingKeyError, TdzError, UnsupportedError
from .sources import Source
from .tdzsource import TdzSource, open_tdz
from .tree import Level

if TYPE_CHECKING:  # pragma: no cover
    from .archive import Archive

__all__ = ["open_archive", "load"]

_PACKAGE = sys.modules[__name__.rpartition(".")[0]]


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
        from ._jit import check_num_threads

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
    """The source of ``path``: its format detected from its bytes by :mod:`tdz_numba.formats`
    (a ``.tdz`` archive reuses the zip index the detection parsed)."""
    formats = _PACKAGE.formats  # (not `from . import formats`: ~20 us of a cold open; a test stubs it)
    sniff = getattr(formats, "sniff", None)
    if sniff is None:
        detect = getattr(formats, "detect", None)
        name = detect(path) if detect is not None else "tdz"
        if name == "tdz":
            return open_tdz(path, mode=mode, allow_pickle=allow_pickle, num_threads=num_threads)
        ctx = None
    else:
        try:
            name, ctx = sniff(path)
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
        source = formats.open_source(path, copy=copy, sniffed=(name, ctx))  # reuses the parsed zip index
        if source is None:  # pragma: no cover - detection said otherwise
            return open_tdz(path, mode=mode, allow_pickle=allow_pickle, num_threads=num_threads)
        return source
    if mode != "r":
        raise UnsupportedError(
            f"{path}: mode={mode!r} is for .tdz archives; a {name} file opens with mode='r'"
        )
    source = formats.open_source(path, copy=copy)
    if source is None:  # pragma: no cover - detection said otherwise
        return open_tdz(path, mode=mode, allow_pickle=allow_pickle, num_threads=num_threads)
    return source


def _plain_zip(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a zip archive of other files (not a TorchScript archive)."""
    from .reader import ArchiveIndex

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
