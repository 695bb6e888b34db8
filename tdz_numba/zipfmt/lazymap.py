"""An archive's mapping made on first use: the descriptor an open read the index with is kept
until a payload is first read, and a process keeps at most :data:`MAX_HELD_DESCRIPTORS` of
them (an open beyond that maps its file at once and closes the descriptor), so that many
archives opened and not yet read never exhaust the descriptor limit (often 1,024).

:class:`LazyMapping` is the part of :class:`~tdz_numba.zipfmt.index.ArchiveIndex` that holds
the mapping and that descriptor; :func:`hold_descriptor` counts one more held descriptor when
the cap allows.

Examples
--------
>>> before = held_descriptors()
>>> hold_descriptor(), held_descriptors() - before
(True, 1)
>>> release_descriptor(); held_descriptors() == before
True
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

from ..errors import BadArchiveError
from ..files.loadadvice import map_cached_ahead

__all__ = [
    "LazyMapping",
    "MAP_LOCK",
    "MAX_HELD_DESCRIPTORS",
    "hold_descriptor",
    "release_descriptor",
    "held_descriptors",
]

#: Taken while a held descriptor is mapped, read or closed (two threads reading the first
#: payloads map the file once; a descriptor stays open while an entry is read through it).
MAP_LOCK = threading.Lock()
#: Descriptors that unmapped indexes may hold at once in a process (see the module).
MAX_HELD_DESCRIPTORS = 64
_HELD = [0]
_HELD_LOCK = threading.RLock()  # (re-entrant: a collection inside it may run LazyMapping.__del__)


def hold_descriptor() -> bool:
    """Counts one more held descriptor where fewer than :data:`MAX_HELD_DESCRIPTORS` are held;
    whether it did (the caller then keeps its descriptor and calls :func:`release_descriptor`
    when it closes it)."""
    with _HELD_LOCK:
        if _HELD[0] < MAX_HELD_DESCRIPTORS:
            _HELD[0] += 1
            return True
    return False


def release_descriptor() -> None:
    """Counts one held descriptor less (see :func:`hold_descriptor`)."""
    with _HELD_LOCK:
        _HELD[0] -= 1


def held_descriptors() -> int:
    """How many descriptors this process's unmapped indexes hold now."""
    return _HELD[0]


class LazyMapping:
    """The whole file's mapping (``_map``), or until it is made the descriptor (``_fd``, counted
    by :func:`hold_descriptor`) that makes it: private (copy-on-write), ``size`` bytes of ``path``."""

    path: Path
    size: int
    _map: mmap.mmap | None = None  # the mapping (None: not made yet, or closed)
    _fd: int | None = None  # a descriptor kept until the file is mapped (an open that read with pread)

    @property
    def _mmap(self) -> mmap.mmap:
        """The private (or shared) mapping of the whole file: made on first use when the open
        read the index with ``pread`` (:func:`tdz_numba.zipfmt.central.parse_tail`); None once closed."""
        mapping = self._map
        if mapping is None and self._fd is not None:
            mapping = self._map_now()
        return mapping  # type: ignore[return-value]

    @_mmap.setter
    def _mmap(self, value: mmap.mmap | None) -> None:
        self._map = value
        if value is None and self._fd is not None:
            with MAP_LOCK:
                self._drop_fd()

    def _map_now(self) -> mmap.mmap | None:
        with MAP_LOCK:  # (two threads reading the first payloads map the file once)
            if self._map is not None or self._fd is None:
                return self._map
            return self._map_fd(self._fd)

    def _map_fd(self, fd: int) -> mmap.mmap:
        label = str(self.path)
        try:
            st = os.fstat(fd)
            if st.st_size < self.size:  # (grown: an append, which rewrites no byte of the opened size)
                raise BadArchiveError(
                    f"{label}: the file shrank since it was opened ({self.size} -> {st.st_size} bytes)",
                    path=label,
                    expected=self.size,
                    found=st.st_size,
                )
            self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_COPY)
            map_cached_ahead(self._map, fd)
        finally:
            self._drop_fd()
        return self._map

    def _drop_fd(self) -> None:
        fd = self._fd
        if fd is not None:
            self._fd = None
            with _HELD_LOCK:  # (what release_descriptor does, without the call)
                _HELD[0] -= 1
            os.close(fd)

    def __del__(self, _close=os.close, _release=release_descriptor) -> None:
        fd = self._fd
        if fd is not None:  # an index dropped unclosed before its file was mapped
            self._fd = None
            try:  # (both bound at definition: module globals may be gone at exit)
                _release()
            except Exception:
                pass
            try:
                _close(fd)
            except OSError:
                pass
