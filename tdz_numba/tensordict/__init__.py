"""tensordict integration: tdz_numba as the ``.tdz`` archive backend of tensordict.

* :func:`save` writes any tensordict collection (same bytes as ``td.save(path)``
  apart from zip timestamps);
* :func:`load` reads an archive back as the class ``TensorDict.load_memmap``
  returns, with leaves as zero-copy views into one mapping of the file;
* :func:`enable` / :func:`disable` / :func:`enabled` make tensordict's own API
  (``save``/``dumps``/``memmap``/``memmap_like`` to a ``.tdz``,
  ``load_memmap``/``load`` of an archive, ``pack_memmap``, ``unpack_memmap``,
  ``is_memmap_archive``, ``refresh_archive_checksums``) use tdz_numba.

tensordict is imported lazily, inside the functions. No class named in an
archive is ever imported by :func:`load`.

Examples
--------
>>> import tempfile, pathlib, torch
>>> from tensordict import TensorDict
>>> import tdz_numba.tensordict as tdt
>>> td = TensorDict(a=torch.arange(3), batch_size=[3])
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdt.save(td, pathlib.Path(d) / "x.tdz")
...     print(type(tdt.load(p)).__name__, tdt.load(p)["a"].tolist())
TensorDict [0, 1, 2]
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, InvalidTreeError, TdzError, UnsupportedError
from .load import LoadContext, load_open, open_tdz_archive

__all__ = ["save", "load", "enable", "disable", "enabled", "is_enabled", "TensordictNotInstalledError"]

SUPPORTED_PREFIX = "0.15."


class TensordictNotInstalledError(TdzError, ImportError):  # type: ignore[misc]  # both define .path (str | None)
    """tensordict is needed for :mod:`tdz_numba.tensordict` but is not installed."""


def _tensordict():
    try:
        import tensordict
    except ImportError as exc:
        raise TensordictNotInstalledError(
            "tdz_numba.tensordict needs the tensordict package: pip install 'tensordict==0.15.*'"
        ) from exc
    return tensordict


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------
def save(
    td: Any,
    path: str | os.PathLike,
    *,
    compression: str | None = None,
    compresslevel: int | None = None,
    existsok: bool = True,
    num_threads: int | None = None,
    allow_pickle: bool = False,
    durable: bool = True,
) -> Path:
    """Writes a tensordict collection to a ``.tdz`` archive, as ``td.save(path)`` does.

    Non-JSON non-tensor data is pickled as tensordict pickles it only with
    ``allow_pickle=True``; otherwise :class:`~tdz_numba.InvalidTreeError`.
    ``durable``: ``fsync`` before and after the rename, as :func:`tdz_numba.save`.
    """
    _tensordict()
    from .. import saving
    from ..tdz.tdcompat import level_from_tensordict

    level = level_from_tensordict(td, allow_pickle=allow_pickle)
    if level is None:
        raise InvalidTreeError(f"expected a tensordict collection, got {type(td).__name__}")
    return saving.save(
        level,
        path,
        compression=compression,
        compresslevel=compresslevel,
        existsok=existsok,
        num_threads=num_threads,
        durable=durable,
    )


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------
def load(
    path: str | os.PathLike,
    *,
    subpath: Any = None,
    mode: str | None = "r",
    device: Any = None,
    num_threads: int | None = None,
    allow_pickle: bool | None = None,
    allowed_classes: tuple = (),
    _pickle_default: str = "refuse",
) -> Any:
    """Loads an archive as ``TensorDict.load_memmap`` would, without importing anything.

    Returns a TensorDict, LazyStackedTensorDict, tensorclass instance,
    NonTensorData or NonTensorStack. Leaves are views into one mapping of the
    file (``mode="r"``: copy-on-write; ``"r+"``: writes reach the file).
    ``device="meta"`` reads no payload. Classes are looked up among imported
    modules and ``allowed_classes`` only (else :class:`~tdz_numba.UnsupportedError`).
    ``allow_pickle``: pickled non-tensor data is loaded only with True; None
    and False raise :class:`~tdz_numba.UnsafeContentError` (nothing read from
    a file runs code unless the caller allows it). Under :func:`enable`,
    tensordict's own ``load_memmap(allow_pickle=None)`` keeps tensordict 0.15's
    documented default: it loads pickles with a FutureWarning.
    """
    _tensordict()
    from .. import api

    if mode is None:
        mode = "r"
    if allow_pickle is not None and not isinstance(allow_pickle, bool):
        raise InvalidArgumentError("allow_pickle must be a bool or None.")
    ctx = LoadContext(device, allow_pickle, allowed_classes, path, _pickle_default)
    return load_open(api.open(path, mode=mode, allow_pickle=False, num_threads=num_threads), ctx, subpath)


# ---------------------------------------------------------------------------
# enable / disable
# ---------------------------------------------------------------------------
_LOCK = threading.RLock()
_SAVED: list[tuple[Any, str, Any]] = []  # (owner, name, original value)

_COMPRESSION_NAMES = {0: None, 8: "deflate", 12: "bzip2", 14: "lzma"}


def _compression_name(compression: Any) -> str | None:
    from tensordict._archive import _resolve_compression

    method = _resolve_compression(compression)  # tensordict's ValueError for unknown names
    if method not in _COMPRESSION_NAMES:
        raise UnsupportedError(f"unsupported zip compression method {method}")
    return _COMPRESSION_NAMES[method]


class _Fallback(Exception):
    pass


def _patched_functions(originals: dict[str, Any]) -> dict[str, Any]:
    """The replacements, closing over tensordict's originals (used as fallbacks)."""
    from tensordict import _archive as tda

    def is_memmap_archive(path):
        from .. import api

        return api.is_archive(path)

    def pack_memmap(prefix, archive_path, *, compression=None, compresslevel=None):
        from .. import saving

        prefix, archive_path = Path(prefix), Path(archive_path)
        if not (prefix / "meta.json").exists():
            raise ValueError(
                f"{prefix} does not look like a memory-mapped tensordict directory (no meta.json found)."
            )
        files = list(tda._iter_memmap_dir(prefix))
        if archive_path.resolve().is_relative_to(prefix.resolve()) or (
            archive_path.exists() and any(p.samefile(archive_path) for p in files)
        ):
            raise ValueError(
                f"The archive path {archive_path} must be outside the source directory "
                f"{prefix} and must not alias a source file."
            )
        target = archive_path.resolve()
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(f"Cannot overwrite {archive_path}: the file is not writable.")
        saving.pack(
            prefix, archive_path, compression=_compression_name(compression), compresslevel=compresslevel
        )
        return archive_path

    def unpack_memmap(archive_path, prefix):
        from .. import api, saving

        archive_path, prefix = Path(archive_path), Path(prefix)
        if not api.is_archive(archive_path):
            raise ValueError(f"{archive_path} is not a memory-mapped tensordict archive.")
        saving.unpack(archive_path, prefix)
        return prefix

    def refresh_archive_checksums(archive_path):
        from .. import api

        archive_path = Path(archive_path)
        if not api.is_archive(archive_path):
            raise ValueError(f"{archive_path} is not a memory-mapped tensordict archive.")
        api.refresh_checksums(archive_path)
        return archive_path

    def _level_or_fallback(td, like: bool):
        from tensordict.base import _NESTED_TENSORS_AS_LISTS
        from tensordict.utils import _is_unbatched

        from ..tdz.tdcompat import level_from_tensordict

        leaves = td.values(True, True, is_leaf=_NESTED_TENSORS_AS_LISTS)
        for value in leaves:
            if _is_unbatched(value) or (like and getattr(value, "is_nested", False)):
                raise _Fallback  # warnings / errors as tensordict raises them
        try:
            return level_from_tensordict(td, allow_pickle=True)
        except (InvalidTreeError, AttributeError, TypeError):
            raise _Fallback from None

    def _save_as_archive(
        td,
        archive_path,
        *,
        num_threads=0,
        compression=None,
        copy_existing=False,
        share_non_tensor=False,
        existsok=True,
        robust_key=True,
    ):
        from .. import saving

        if robust_key is not True:
            return originals["_save_as_archive"](
                td,
                archive_path,
                num_threads=num_threads,
                compression=compression,
                copy_existing=copy_existing,
                share_non_tensor=share_non_tensor,
                existsok=existsok,
                robust_key=robust_key,
            )
        archive_path = Path(archive_path)
        tda._check_archive_target(archive_path, existsok)
        name = _compression_name(compression)
        saved_prefix = getattr(td, "_memmap_prefix", None)
        if td.is_memmap() and isinstance(saved_prefix, Path) and (saved_prefix / "meta.json").exists():
            return pack_memmap(saved_prefix, archive_path, compression=compression)
        try:
            level = _level_or_fallback(td, like=False)
        except _Fallback:
            return originals["_save_as_archive"](
                td,
                archive_path,
                num_threads=num_threads,
                compression=compression,
                copy_existing=copy_existing,
                share_non_tensor=share_non_tensor,
                existsok=True,
                robust_key=robust_key,
            )
        saving.save(level, archive_path, compression=name)
        return archive_path

    def _make_archive_like(
        td,
        archive_path,
        *,
        num_threads=0,
        copy_existing=False,
        share_non_tensor=False,
        existsok=True,
        robust_key=True,
    ):
        from ..files.paths import user_errors
        from ..tdz.tree import flatten
        from ..zipfmt import writer

        fallback_kw = dict(
            num_threads=num_threads,
            copy_existing=copy_existing,
            share_non_tensor=share_non_tensor,
            robust_key=robust_key,
        )
        if robust_key is not True:
            return originals["_make_archive_like"](td, archive_path, existsok=existsok, **fallback_kw)
        archive_path = Path(archive_path)
        tda._check_archive_target(archive_path, existsok)
        try:
            level = _level_or_fallback(td, like=True)
        except _Fallback:
            return originals["_make_archive_like"](td, archive_path, existsok=True, **fallback_kw)
        with user_errors(archive_path, action="write"):
            writer.write_entries(flatten(level, zeros=True), writer.check_target(archive_path, True))
        return archive_path

    orig_load_memmap = originals["TensorDictBase.load_memmap"].__func__

    def load_memmap(
        cls,
        prefix,
        device=None,
        non_blocking=False,
        *,
        out=None,
        robust_key=True,
        subpath=None,
        mode=None,
        num_threads=0,
        allow_pickle=None,
    ):
        import torch
        from tensordict._archive import _ArchivePath

        if (
            out is None
            and robust_key is True
            and mode in (None, "r", "r+")
            and (allow_pickle is None or isinstance(allow_pickle, bool))
            and isinstance(prefix, (str, os.PathLike))
            and not isinstance(prefix, _ArchivePath)
            and not torch._guards.active_fake_mode()
        ):
            path = Path(prefix)
            ar = open_tdz_archive(
                path,
                mode or "r",
                num_threads if num_threads and num_threads > 1 else 1,
                check_local=subpath is None,  # the whole archive is read: every local header at open
            )
            if ar is not None:
                ctx = LoadContext(device, allow_pickle, (cls,), path, "warn")
                try:
                    result = load_open(ar, ctx, subpath)
                except UnsupportedError as exc:
                    if "tdz_numba never imports" not in str(exc):
                        raise
                    # a class tensordict may still find (registered classes): its own path
                else:
                    if (
                        not non_blocking
                        and device is not None
                        and torch.device(device).type not in ("meta", "cuda")
                    ):
                        result._sync_all()
                    return result
        return orig_load_memmap(
            cls,
            prefix,
            device,
            non_blocking,
            out=out,
            robust_key=robust_key,
            subpath=subpath,
            mode=mode,
            num_threads=num_threads,
            allow_pickle=allow_pickle,
        )

    load_memmap.__doc__ = orig_load_memmap.__doc__
    load_memmap.__name__ = orig_load_memmap.__name__
    load_memmap.__qualname__ = orig_load_memmap.__qualname__
    load_memmap.__wrapped__ = orig_load_memmap  # type: ignore[attr-defined]  # functools.wraps-style marker
    return {
        "is_memmap_archive": is_memmap_archive,
        "pack_memmap": pack_memmap,
        "unpack_memmap": unpack_memmap,
        "refresh_archive_checksums": refresh_archive_checksums,
        "_save_as_archive": _save_as_archive,
        "_make_archive_like": _make_archive_like,
        "TensorDictBase.load_memmap": classmethod(load_memmap),
    }


def _patch_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, replacement key): every binding tensordict calls."""
    import tensordict
    from tensordict import _archive
    from tensordict._base import serialization

    points: list[tuple[Any, str, str]] = []
    for name in (
        "is_memmap_archive",
        "pack_memmap",
        "unpack_memmap",
        "refresh_archive_checksums",
        "_save_as_archive",
        "_make_archive_like",
    ):
        for module in (_archive, serialization, tensordict):
            if name in vars(module):
                points.append((module, name, name))
    owner = next(c for c in tensordict.TensorDictBase.__mro__ if "load_memmap" in vars(c))
    points.append((owner, "load_memmap", "TensorDictBase.load_memmap"))
    return points


def enable() -> None:
    """Makes tensordict's archive API use tdz_numba (idempotent; see :func:`disable`)."""
    td = _tensordict()
    if not str(getattr(td, "__version__", "")).startswith(SUPPORTED_PREFIX):
        raise UnsupportedError(
            f"tdz_numba.tensordict.enable() supports tensordict {SUPPORTED_PREFIX}x only, "
            f"found {getattr(td, '__version__', 'unknown')}"
        )
    with _LOCK:
        if _SAVED:
            return
        from tensordict import _archive

        points = _patch_points()
        originals = {name: getattr(_archive, name) for _, _, name in points if hasattr(_archive, name)}
        owner = points[-1][0]
        originals["TensorDictBase.load_memmap"] = vars(owner)["load_memmap"]
        replacements = _patched_functions(originals)
        for owner, attr, key in points:
            _SAVED.append((owner, attr, vars(owner)[attr]))
            setattr(owner, attr, replacements[key])


def disable() -> None:
    """Restores tensordict's own functions exactly (no-op when not enabled)."""
    with _LOCK:
        while _SAVED:
            owner, attr, original = _SAVED.pop()
            setattr(owner, attr, original)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return bool(_SAVED)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Context manager: tdz_numba backs tensordict archives inside the block.

    Re-entrant: the state on entry is restored on exit.
    """
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
