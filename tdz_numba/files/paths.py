"""The user's path: what tdz_numba accepts as one, and OS errors that name it.

* :func:`as_local_path` is the single place that decides whether an argument is
  a local file-system path. File objects and URLs raise a clear
  :class:`~tdz_numba.UnsupportedError` (a later version routes URLs to fsspec
  here); ``file://`` URLs are local paths.
* :func:`user_errors` turns the built-in ``FileNotFoundError`` /
  ``PermissionError`` / disk-full ``OSError`` raised inside an operation into
  :class:`~tdz_numba.FileMissingError` / :class:`~tdz_numba.AccessDeniedError`
  / :class:`~tdz_numba.DiskFullError` naming the user's path, never an
  internal temporary name.

Examples
--------
>>> from tdz_numba.files.paths import as_local_path
>>> as_local_path("file:///tmp/x.tdz").as_posix()
'/tmp/x.tdz'
>>> try:
...     as_local_path("s3://bucket/x.tdz")
... except NotImplementedError as e:
...     print(str(e)[:47])
's3://bucket/x.tdz': URLs are not supported yet
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import (
    AccessDeniedError,
    DiskFullError,
    FileMissingError,
    InvalidArgumentError,
    TdzError,
    UnsupportedError,
)

__all__ = ["as_local_path", "is_url", "user_errors", "DISK_FULL_ERRNOS"]

#: ``scheme://`` with a scheme of 2+ characters (``C:\\`` stays a path).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
#: errno values reported as :class:`~tdz_numba.DiskFullError`.
DISK_FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG) if e)


def is_url(text: str) -> bool:
    """Whether ``text`` looks like ``scheme://...`` (a URL, not a local path)."""
    return bool(_URL.match(text))


def as_local_path(obj: Any, *, what: str = "archive") -> Path:
    """The local path named by ``obj`` (str, bytes or os.PathLike), unchanged.

    Raises
    ------
    UnsupportedError
        For file objects (``io.BytesIO``, open files, ...) and URLs other than
        ``file://`` (``s3://``, ``https://``, ...): not supported yet. The
        message quotes the URL exactly as given.
    InvalidArgumentError
        For anything else that is not a path.

    Examples
    --------
    >>> import io
    >>> from tdz_numba.files.paths import as_local_path
    >>> try:
    ...     as_local_path(io.BytesIO())
    ... except NotImplementedError as e:
    ...     print(type(e).__name__)
    UnsupportedError
    """
    if isinstance(obj, (str, bytes, os.PathLike)):
        text = os.fspath(obj)
        if isinstance(text, bytes):
            text = os.fsdecode(text)
        if is_url(text):
            parts = urlsplit(text)
            if parts.scheme.lower() == "file" and parts.netloc in ("", "localhost"):
                return Path(unquote(parts.path))
            raise UnsupportedError(
                f"{text!r}: URLs are not supported yet: tdz_numba reads and writes local "
                f"files (memory-mapped); copy the {what} to a local path first"
            )
        return obj if isinstance(obj, Path) else Path(text)
    if hasattr(obj, "read") or hasattr(obj, "write") or isinstance(obj, (bytearray, memoryview)):
        raise UnsupportedError(
            f"file objects ({type(obj).__name__}) are not supported yet: tdz_numba memory-maps "
            f"the {what}; pass a path (str or os.PathLike) instead"
        )
    raise InvalidArgumentError(f"expected the {what}'s path (str or os.PathLike), got {type(obj).__name__}")


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


@contextlib.contextmanager
def user_errors(path: Any, *, action: str = "open") -> Iterator[None]:
    """Re-raises built-in OS errors of the block as TdzError subclasses naming ``path``.

    ``action`` ("open", "write", "unpack into", ...) words the message. Errors
    that already derive from :class:`~tdz_numba.TdzError` pass unchanged.
    """
    try:
        yield
    except TdzError:
        raise
    except FileNotFoundError as exc:
        other = (
            exc.filename if exc.filename is not None and os.fspath(exc.filename) != os.fspath(path) else None
        )
        hint = "" if other is None or _internal(other) else f" ({other} is missing)"
        raise _oserror(
            FileMissingError, errno.ENOENT, f"cannot {action} {path}: no such file or directory{hint}", path
        ) from None
    except PermissionError as exc:
        raise _oserror(
            AccessDeniedError,
            exc.errno or errno.EACCES,
            f"cannot {action} {path}: {_why(exc).lower()}{_dir_hint(path, exc)}",
            path,
        ) from None
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise _oserror(
                DiskFullError, exc.errno or errno.ENOSPC, f"cannot {action} {path}: {_why(exc).lower()}", path
            ) from None
        if exc.errno == errno.EROFS:
            raise _oserror(
                AccessDeniedError, exc.errno, f"cannot {action} {path}: read-only file system", path
            ) from None
        raise


def _oserror(cls: type[OSError], err: int, message: str, path: Any) -> OSError:
    """``cls(message)`` (so that ``str()`` is the message) with ``errno`` and ``filename`` set."""
    exc = cls(message)
    exc.errno = err
    try:
        exc.filename = os.fspath(path)
    except TypeError:
        pass
    if hasattr(exc, "path"):  # TdzError's attribute
        exc.path = exc.filename
    return exc


def _internal(name: Any) -> bool:
    return ".tdz-tmp." in os.fspath(name) if isinstance(name, (str, bytes, os.PathLike)) else False


def _dir_hint(path: Any, exc: OSError) -> str:
    """`` (the directory D is not writable)`` when the error came from a temp name or the parent."""
    try:
        parent = Path(os.fspath(path)).parent
    except TypeError:
        return ""
    if exc.filename is not None and (_internal(exc.filename) or Path(os.fspath(exc.filename)) == parent):
        return f" (the directory {parent} is not writable)"
    return ""
