"""Small scattered reads that leave the page cache as they found it, and the page cache's residency.

A whole-archive open reads one small header per entry (a zip local header, 30 bytes and a name) with
``pread``. Those reads used to leave each header's page in the page cache as a lone 4 KiB folio. On a
kernel whose file system caches files in large folios (ext4 on Linux 6.18 here), a later page fault
of the mapping reads ahead into large folios only where the range it reads around holds no cached
page: one stray 4 KiB page in the read-around window (8 MiB with this disk's ``read_ahead_kb``) and
the rest of the window comes in as 4 KiB folios (and a 2 MiB folio needs its whole aligned block
free). The misses go to the disk together: the ``RWF_NOWAIT`` pass over every
piece starts each miss's read before the plain reads wait for them (one read after the other, a
146-header ``.tdz`` paid 146 disk round trips: 1.0 s of a cold load's time with another process
reading the same disk, against 59 ms for the one header of a ``.safetensors``). Measured on a 512 MiB model-shaped ``.tdz`` of 146 leaves: after a cache drop and a load that
read the headers, 62% of the file sat in 4 KiB folios and every later mmap + touch of it cost 23 ms
(6,500 page faults), against 2.4 ms (500 faults, 2 MiB folios) after a plain mmap + touch.

:func:`read_pieces` reads the pieces first with ``RWF_NOWAIT`` (served only from the page cache, so a
cached piece costs one system call as before and nothing changes), then the missing pieces with
``POSIX_FADV_RANDOM`` on its descriptor (exactly the pages asked for, no read-ahead), and drops those
pages again (``POSIX_FADV_DONTNEED`` on exactly the pages that were not cached before). The mapping's
first fault there then reads them back with the rest of its block in large folios (with
:func:`tdz_numba.files.loadadvice.whole_file_mappings` around a load: 2 MiB folios in any touch order;
either change alone left the warm touch at 15-21 ms there).
:func:`cached` says which pages of a file are in the page cache (``mincore`` of a mapping never
touched), for tests and diagnostics; :func:`looks_cached`, from a few pages, whether all of an open
file seems to be (``cachestat``, else ``RWF_NOWAIT`` reads: what a load asks before it maps a file
ahead).

Examples
--------
>>> import os, tempfile
>>> from tdz_numba.files import pagecache
>>> with tempfile.NamedTemporaryFile() as f:
...     _ = f.write(bytes(range(256)) * 64); f.flush()
...     fd = os.open(f.name, os.O_RDONLY)
...     try:
...         pieces = pagecache.read_pieces(fd, [1, 4097], [3, 2])
...     finally:
...         os.close(fd)
...     print(bytes(pieces), bool(pagecache.cached(f.name, 0, 4096)[0]))  # cached before: left cached
b'\\x01\\x02\\x03\\x01\\x02' True
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

from ..errors import UnsupportedError
from . import libc

__all__ = ["read_pieces", "read_full", "cached", "looks_cached", "drop_pages", "SAMPLES"]

_PAGE = mmap.PAGESIZE
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_FADVISE = hasattr(os, "posix_fadvise")
#: ``preadv`` with ``RWF_NOWAIT`` answered "not supported" in this process: plain reads from then on.
_NOWAIT_REFUSED: list[bool] = []


def read_pieces(fd: int, offsets: Sequence[int], sizes: Sequence[int]) -> bytearray:
    """The bytes of ``[offsets[i], offsets[i] + sizes[i])`` of the file open as ``fd``, one piece
    after the other (bytes past the end of the file read as zeros), read without leaving in the page
    cache any page that was not there before.

    Every piece is read with ``preadv(RWF_NOWAIT)`` first (served from the page cache: one call
    per cached piece, as a plain ``pread``; a miss answers at once and has started the read of its
    pages, so the misses of all the pieces are in flight together), then the rest of each piece the
    cache lacked with a plain ``preadv`` (waiting for its read), all with read-ahead off (``POSIX_FADV_RANDOM`` on ``fd``, set back to
    ``POSIX_FADV_NORMAL`` after: the descriptor is best the caller's own), and the pages the
    misses brought in are dropped again (``POSIX_FADV_DONTNEED`` on exactly those pages). Where
    the kernel has no ``RWF_NOWAIT`` for this file, every piece is read with plain ``preadv``
    (nothing dropped). See the module's doc for why.

    Examples
    --------
    >>> import os, tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"abcdef"); f.flush()
    ...     read_pieces(f.fileno(), [4, 0, 5], [2, 1, 3])  # the last piece runs past the end
    bytearray(b'efaf\\x00\\x00')
    """
    sizes = [int(n) for n in sizes]
    offsets = [int(o) for o in offsets]
    out = bytearray(sum(sizes))
    view = memoryview(out)
    starts = [0] * len(sizes)
    pos = 0
    for i, n in enumerate(sizes):
        starts[i] = pos
        pos += n
    flag = _NOWAIT if _FADVISE and not _NOWAIT_REFUSED else None
    if flag is not None:
        # read-ahead off while reading: a miss (even one that RWF_NOWAIT refuses, which still
        # starts the read) brings in exactly the pages of its piece
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:  # (a file system that takes no advice: plain reads)
            flag = None
    if flag is None:  # plain reads, nothing known about what was cached
        for i, n in enumerate(sizes):
            read_full(fd, view[starts[i] : starts[i] + n], offsets[i])
        return out
    pages: list[tuple[int, int]] = []  # (first, stop) of the pages read in that were not cached
    try:
        # first pass: every piece with RWF_NOWAIT. A cached piece is read; a miss returns EAGAIN
        # but has started its read (the kernel's read-ahead of exactly its pages), so the
        # misses of the whole batch go to the disk together, not one round trip each
        misses, known = _read_cached(fd, view, starts, offsets, sizes, flag)
        size = -1
        for i, done in misses:  # second pass: wait for the misses
            off, n = offsets[i], sizes[i]
            if done:  # cached up to a page that is not, or the end of the file
                size = os.fstat(fd).st_size if size < 0 else size
                if off + done >= size:
                    continue
            start = off + done
            read = read_full(fd, view[starts[i] + done : starts[i] + n], start)
            if read and i < known:  # (from ``known`` on the file refused RWF_NOWAIT: nothing dropped)
                pages.append((start // _PAGE, -(-(start + read) // _PAGE)))
    finally:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
            drop_pages(fd, pages)
        except OSError:  # advice only: never an error
            pass
    return out


def _read_cached(
    fd: int, view: memoryview, starts: list[int], offsets: list[int], sizes: list[int], flag: int
) -> tuple[list[tuple[int, int]], int]:
    """The first pass of :func:`read_pieces`: each piece of some bytes read with ``preadv(flag)``
    (``RWF_NOWAIT``) into ``view``, in order, by one C-level ``map`` (no Python step per cached
    piece: ~0.1 us a header against ~0.5 in a loop; a miss's ``EAGAIN`` interrupts the ``map`` for
    its piece only, the same iterator goes on with the next). Returns ``(misses, known)``:
    ``(piece, bytes read)`` of every piece not read whole, and the piece from which the file
    refused the flag (``len(sizes)`` when it never did: the second pass reads the pieces from
    there on plainly, knowing nothing of the cache)."""
    live = [i for i, n in enumerate(sizes) if n]
    m = len(live)
    bufs = [[view[starts[i] : starts[i] + sizes[i]]] for i in live]
    calls = map(os.preadv, repeat(fd, m), bufs, [offsets[i] for i in live], repeat(flag, m))
    got: list[int] = []
    known = len(sizes)
    while len(got) < m:
        try:
            got.extend(calls)
        except BlockingIOError:  # not cached (EAGAIN): its read has started
            got.append(0)
        except OSError as exc:  # EOPNOTSUPP / EINVAL: this file takes no RWF_NOWAIT
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _NOWAIT_REFUSED.append(True)
            known = live[len(got)]
            got.extend(repeat(0, m - len(got)))
    return [(i, g) for i, g in zip(live, got) if g < sizes[i]], known


def drop_pages(fd: int, pages: Sequence[tuple[int, int]]) -> int:
    """Drops the pages ``[first, stop)`` of each pair from the page cache (``POSIX_FADV_DONTNEED``,
    adjacent or overlapping pairs merged into one call); the number of calls made. Dirty or mapped
    pages are left where they are (the kernel's rule)."""
    if not pages or not _FADVISE:
        return 0
    calls = 0
    spans = sorted(pages)
    first, stop = spans[0]
    for a, b in spans[1:] + [(-1, -1)]:
        if 0 <= a <= stop:
            stop = max(stop, b)
            continue
        os.posix_fadvise(fd, first * _PAGE, (stop - first) * _PAGE, os.POSIX_FADV_DONTNEED)
        calls += 1
        first, stop = a, b
    return calls


def cached(path: str | os.PathLike, offset: int, nbytes: int) -> np.ndarray:
    """Whether each page of ``[offset, offset + nbytes)`` of the file ``path`` is in the page cache
    (a bool per page; ``mincore`` of a new mapping that nothing touches, so the question changes
    nothing). The kernel answers for files this process may write to or owns; others raise
    :class:`~tdz_numba.UnsupportedError` where ``mincore`` is missing or fails."""
    start = offset // _PAGE * _PAGE
    length = offset + nbytes - start
    pages = -(-length // _PAGE)
    if pages <= 0:
        return np.zeros(0, bool)
    mincore = libc.function("mincore")
    if mincore is None:  # pragma: no cover - every Linux and macOS libc has it
        raise UnsupportedError("cached: this platform's C library has no mincore")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        arr = np.frombuffer(mm, np.uint8)
        base = arr.ctypes.data
        vec = (ctypes.c_ubyte * pages)()
        rc = mincore(ctypes.c_void_p(base + start), ctypes.c_size_t(length), vec)
        del arr
        if rc != 0:
            err = ctypes.get_errno()
            raise UnsupportedError(f"cached: mincore of {os.fspath(path)!r} failed: {os.strerror(err)}")
    return (np.frombuffer(vec, np.uint8) & 1).astype(bool)  # type: ignore[call-overload]  # ctypes arrays are buffers


#: Pages of a file :func:`looks_cached` asks about, evenly spaced.
SAMPLES = 16
#: ``cachestat(2)``'s number (Linux 6.5 and later: the same on every architecture).
_CACHESTAT = 451
#: ``cachestat`` answered "no such call" or "not allowed" in this process: RWF_NOWAIT reads from then on.
_CACHESTAT_REFUSED: list[bool] = []


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def looks_cached(fd: int, size: int) -> bool:
    """Whether the file open as ``fd`` (``size`` bytes) looks cached: each of :data:`SAMPLES`
    pages spread over it is in the page cache. False where the platform or the file system
    cannot say.

    Asked with ``cachestat`` (Linux 6.5+: one call a page, ~2 us, nothing read), else with a
    one-byte ``preadv`` of each page with ``RWF_NOWAIT``. That read is not a pure question: a
    miss starts the read of its page, and where the disk answers before the call checks the
    page (a virtual disk whose host caches the file, a busy CPU), the page reads as cached:
    a file just dropped from the cache then looked cached (1 load in 10 of
    ``tests/test_pagecache.py``'s reversed file, before ``cachestat``). A miss stops the sample.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"x" * 8192); f.flush()
    ...     looks_cached(f.fileno(), 8192) in (True, False)
    True
    """
    if fd < 0 or size <= 0:
        return False
    step = max(1, (size - 1) // max(1, SAMPLES - 1))
    asked = _cachestat_all(fd, range(0, size, step))
    if asked is not None:
        return asked
    if _NOWAIT is None or _NOWAIT_REFUSED:
        return False
    one = bytearray(1)
    try:
        for at in range(0, size, step):
            if os.preadv(fd, [one], at, _NOWAIT) != 1:
                return False
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot say
        return False
    return True


def _cachestat_all(fd: int, offsets: range) -> bool | None:
    """Whether the page at each of ``offsets`` of ``fd`` is cached, asked with ``cachestat``
    (which reads nothing); None where this kernel has no such call or refuses it."""
    call = libc.function("syscall") if sys.platform.startswith("linux") and not _CACHESTAT_REFUSED else None
    if call is None:
        return None
    span, stat = _Range(0, 1), _Stat()
    where, out = ctypes.byref(span), ctypes.byref(stat)
    for at in offsets:
        span.off = at
        if call(_CACHESTAT, fd, where, out, 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL):
                _CACHESTAT_REFUSED.append(True)  # (no cachestat here, or not for this caller)
            return None
        if not stat.cache:
            return False
    return True


def read_full(fd: int, buf: Any, offset: int) -> int:
    """``preadv`` into the buffer ``buf`` (bytes-like, 1-D) until it is full or the file ends; the
    bytes read."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done
