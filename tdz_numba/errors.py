"""The exception tree of tdz_numba.

Every error raised on bad input derives from :class:`TdzError`, and also from
the built-in exception a caller would expect (``ValueError``,
``NotImplementedError``, ``FileExistsError``, ``RuntimeError``), so that
``except ValueError`` keeps working.

Errors carry their data as attributes, as numcodecs' errors do: ``path`` (the
archive), ``entry`` (the entry name), ``offset`` (a byte offset in the file),
``expected`` and ``found`` (the values compared); each is None where it does
not apply. The message repeats them for people.

Examples
--------
>>> import tdz_numba
>>> issubclass(tdz_numba.BadArchiveError, ValueError)
True
>>> e = tdz_numba.BadArchiveError("x.tdz: bad", path="x.tdz", offset=12)
>>> (e.path, e.offset, e.entry, str(e))
('x.tdz', 12, None, 'x.tdz: bad')
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TdzError",
    "BadArchiveError",
    "ChecksumError",
    "UnsupportedError",
    "ArchiveExistsError",
    "UnsafeContentError",
    "InvalidTreeError",
    "InvalidArgumentError",
    "MissingKeyError",
    "UnknownCompressionError",
    "InternalError",
    "FileMissingError",
    "AccessDeniedError",
    "DiskFullError",
    "RemoteError",
]


class TdzError(Exception):
    """Root of every error raised by tdz_numba.

    Parameters
    ----------
    message : str
        The whole human-readable message.
    path, entry, offset, expected, found
        The data of the error, kept as attributes of the same names (None
        where they do not apply).
    """

    path: object
    entry: str | None
    offset: int | None
    expected: object
    found: object

    def __init__(
        self,
        *args: object,
        path: object = None,
        entry: str | None = None,
        offset: int | None = None,
        expected: object = None,
        found: object = None,
    ) -> None:
        super().__init__(*args)
        self.path = None if path is None else str(path)
        self.entry = entry
        self.offset = offset
        self.expected = expected
        self.found = found


class BadArchiveError(TdzError, ValueError):
    """The file is not a well-formed archive, or a tree cannot be written as one.

    The message names the entry, the offset, and the expected and found values
    where they apply.
    """


class ChecksumError(BadArchiveError):
    """An entry's bytes do not match the CRC-32 recorded in the archive."""


class UnsupportedError(TdzError, NotImplementedError):
    """A valid request that tdz_numba cannot do: an encrypted entry, an unknown
    compression method, a write-through view of a compressed leaf, ..."""


class UnknownCompressionError(UnsupportedError, ValueError):
    """An unknown compression name was passed to ``save``/``pack``."""


class ArchiveExistsError(TdzError, FileExistsError):
    """``save(..., existsok=False)`` found a file at the target path."""


class UnsafeContentError(TdzError, RuntimeError):
    """The archive holds pickled data and the caller did not allow unpickling."""


class InvalidTreeError(TdzError, ValueError):
    """``save`` was given a tree it cannot write: an unsupported value type,
    a key that collides with a reserved meta.json field, ..."""


class InvalidArgumentError(TdzError, ValueError):
    """A bad argument: an unknown ``mode``, a negative thread count, ..."""


class MissingKeyError(TdzError, KeyError):
    """A key or ``subpath`` that the archive does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class InternalError(TdzError, RuntimeError):
    """tdz_numba broke one of its own invariants (a bug: please report it),
    e.g. a header whose length differs from the layout plan."""


# -- file-system errors (safety helper): they name the user's path, never a temp name --
class _OSMessage:
    """``str()`` is the message, also when ``errno`` / ``filename`` are set."""

    args: tuple[Any, ...]  # provided by the OSError subclass it is mixed into

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class FileMissingError(_OSMessage, TdzError, FileNotFoundError):
    """The archive (or directory) named by the caller does not exist."""


class AccessDeniedError(_OSMessage, TdzError, PermissionError):
    """The caller's path cannot be read or written (permissions, read-only file system)."""


class DiskFullError(_OSMessage, TdzError, OSError):
    """The file system has no room for the archive (``ENOSPC``/``EDQUOT``/``EFBIG``);
    nothing was left behind."""


class RemoteError(TdzError, OSError):
    """A remote object (fsspec URL) could not be read or written: a network failure
    after retries, a short read, a missing object, a failed upload. The message and
    ``path``/``entry``/``offset`` name the URL and the entries concerned."""
