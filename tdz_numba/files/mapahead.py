"""The page tables of a cached file that a load reads whole, filled on another core.

A zero-copy load returns views of a new mapping: the first touch of each page faults, and
on a mapping of a file already in the page cache those faults are all the first pass over
the tensors costs beyond reading memory (on this machine 1-2 ms for a 512 MiB model whose
cache holds 2 MiB folios, 15-25 ms where it holds the 4-64 KiB folios that most writers
leave). :func:`map_ahead` hands the mapping to one background thread that reads a byte of
every :data:`STEP` bytes of it, from the end backwards, so that the faults are taken on
another core while the caller makes and starts using the views; a caller that goes through
the tensors in file order meets the thread in the middle, and each fault happens once,
whoever takes it. The read is one numpy reduction over a strided view (no Python step per
page, the GIL released while it runs); the thread holds the mapping until it is done.

Only where it cannot read the disk and can pay: a file that a whole-file load maps
(:func:`~tdz_numba.files.loadadvice.map_cached_ahead`, called as the file is mapped, before
its headers are parsed) whose sampled pages are all cached
(:func:`~tdz_numba.files.pagecache.looks_cached`), a mapping of at
least :data:`MIN_BYTES`, at least two CPUs this process may run on, at most
:data:`MAX_PENDING` mappings waiting, and not turned off with ``TDZ_NUMBA_MAPAHEAD=0``.

>>> import mmap
>>> mm = mmap.mmap(-1, 1 << 20)
>>> map_ahead(mm, min_bytes=0) in (True, False), wait_map_ahead(10)
(True, True)
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import weakref
from typing import Any

import numpy as np

__all__ = [
    "map_ahead",
    "map_ahead_on",
    "queued",
    "wait_map_ahead",
    "MIN_BYTES",
    "STEP",
    "MAX_PENDING",
    "ENV",
]

#: Mappings smaller than this are not mapped ahead (waking the thread costs ~0.1 ms).
MIN_BYTES = 16 << 20
#: One byte read in this many: Linux's default fault-around window (each fault of a cached
#: file maps the pages of its 64 KiB around the address, a whole 2 MiB folio where it can).
STEP = 64 << 10
#: Mappings queued at most; more are left to the caller's own faults.
MAX_PENDING = 4
#: ``TDZ_NUMBA_MAPAHEAD=0`` turns it off.
ENV = "TDZ_NUMBA_MAPAHEAD"


def map_ahead_on(nbytes: int, min_bytes: int = MIN_BYTES) -> bool:
    """Whether a mapping of ``nbytes`` would be mapped ahead: large enough, two CPUs or more
    for this process, not turned off (the file's cache is the caller's to check:
    :func:`~tdz_numba.files.pagecache.looks_cached`).

    >>> map_ahead_on(0)
    False
    """
    if nbytes < max(1, min_bytes) or os.environ.get(ENV, "1") == "0":
        return False
    return _cpus() >= 2


_CPUS: dict[int, int] = {}


def _cpus() -> int:
    """The CPUs this process may run on (asked once per process: ~30 us with cold caches)."""
    pid = os.getpid()
    n = _CPUS.get(pid)
    if n is None:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
            n = os.cpu_count() or 1
        _CPUS.clear()
        _CPUS[pid] = n
    return n


class _Worker:
    """The one background thread of this process (a forked child starts its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending = 0
        self.idle = threading.Event()
        self.idle.set()
        threading.Thread(target=self._run, name="tdz_numba-mapahead", daemon=True).start()

    def put(self, buf: np.ndarray) -> bool:
        with self.lock:
            if self.pending >= MAX_PENDING:
                return False
            self.pending += 1
            self.idle.clear()
        self.jobs.put(buf)
        return True

    def _run(self) -> None:
        while True:
            buf = self.jobs.get()
            try:
                if buf.size:
                    np.bitwise_or.reduce(buf[::-STEP])  # the faults: one strided pass, GIL released
            except Exception:  # pragma: no cover - a hint only: the caller's own touches report
                pass
            finally:
                del buf  # (the mapping may be unmapped now)
                with self.lock:
                    self.pending -= 1
                    if not self.pending:
                        self.idle.set()


_WORKER: list[_Worker] = []
_START = threading.Lock()


def _forget() -> None:
    """In a forked child: no thread, a fresh lock (another thread of the parent may have held it)."""
    global _START
    _WORKER.clear()
    _START = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _worker() -> _Worker:
    with _START:
        if not _WORKER or _WORKER[0].pid != os.getpid():
            _WORKER[:] = [_Worker()]
        return _WORKER[0]


def map_ahead(mm: mmap.mmap | Any, *, min_bytes: int = MIN_BYTES) -> bool:
    """Queues the mapping ``mm`` (an ``mmap.mmap`` or any buffer) for the background thread,
    which faults its pages in, last to first (see the module); returns at once, whether it was
    queued (:func:`map_ahead_on`, at most :data:`MAX_PENDING` waiting). The caller checks that
    the file is cached: a page that is not is read from the disk by the thread."""
    try:
        nbytes = len(mm)
    except TypeError:
        return False
    if not map_ahead_on(nbytes, min_bytes) or queued(mm):
        return False
    if not _worker().put(np.frombuffer(mm, dtype=np.uint8)):
        return False
    try:
        _QUEUED.add(mm)
    except TypeError:  # pragma: no cover - a buffer without weak references
        pass
    return True


#: The mappings handed to the thread (each once; gone with the mapping).
_QUEUED: weakref.WeakSet[Any] = weakref.WeakSet()


def queued(mm: Any) -> bool:
    """Whether :func:`map_ahead` took the mapping ``mm`` (an ``mmap.mmap``) already.

    >>> queued(mmap.mmap(-1, 4096))
    False
    """
    try:
        return mm in _QUEUED
    except TypeError:  # pragma: no cover - a buffer without weak references
        return False


def wait_map_ahead(timeout: float | None = None) -> bool:
    """Waits until no mapping is queued or being mapped (at most ``timeout`` seconds); whether
    that is so.

    >>> wait_map_ahead(0)
    True
    """
    with _START:
        w = _WORKER[0] if _WORKER and _WORKER[0].pid == os.getpid() else None
    return True if w is None else w.idle.wait(timeout)
