"""The exception tree of tdz_numba.

Every error raised on bad input derives from :class:`TdzError`, and also from
the built-in exception a caller would expect (``ValueError``,
``NotImplementedError``, ``FileExistsError``, ``RuntimeError``), so that
``except ValueError`` keeps working.

Examples
--------
>>> import tdz_numba
>>> issubclass(tdz_numba.BadArchiveError, ValueError)
True
"""

from __future__ import annotations

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
]


class TdzError(Exception):
    """Root of every error raised by tdz_numba."""


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
