"""The huge-page advice of the files a load reads whole: given once the load's views are made,
by the order in which it lists the leaves (see :class:`whole_file_mappings`).

>>> import numpy as np
>>> in_file_order(np.array([0, 4096, 8192]))
True
"""

from __future__ import annotations

import ctypes
import mmap
import os
from contextvars import ContextVar

import numpy as np

from . import libc
from .mapahead import map_ahead, map_ahead_on, queued
from .memory import _POPULATE_READ, PAGE_SIZE, _address, _populate_supported, advise_huge_mapping
from .pagecache import looks_cached

__all__ = [
    "whole_file_mappings",
    "whole_file_load",
    "BACK_STEPS",
    "in_file_order",
    "advise_whole_file",
    "map_cached_ahead",
    "CACHE_SAMPLE",
]

_WHOLE_FILE: ContextVar[bool] = ContextVar("tdz_numba_whole_file_mappings", default=False)


class whole_file_mappings:  # noqa: N801 - a context manager used as a function (a class: ~1 us less a load)
    """Inside it, a load is reading whole files (``tdz_numba.load``'s views: every page will be
    read): :func:`advise_whole_file` then advises each file's mapping once its views are made.

    The advice (``MADV_HUGEPAGE``) makes the kernel read what a page fault needs in 2 MiB
    folios. Where the leaves, in the order the load lists them (the order a caller touches them
    in), read the file forward (:func:`in_file_order`), that is all: the faults stream through
    the file. Where they jump back and forth (tensordict's ``.tdz``: payloads by name, keys in
    save order; HDF5: datasets in creation order, keys by name), each jump would be a
    synchronous 2 MiB read, so the load reads the whole mapping itself first, forward
    (``MADV_POPULATE_READ``), when the file is at most half this machine's memory and not mostly
    cached already. Measured here on 512 MiB model-shaped files, cold, touched in key order
    (``tdz bench --read-formats`` rounds, medians of 7-9): files in key order (safetensors,
    ``.pt``, GGUF) in 260-323 ms with the advice against 412-563 ms without; tensordict's
    ``.tdz`` of a model (keys out of file order) 789 ms with the advice alone, 343-432 ms
    without it (and its pages then left in 4-16 KiB folios: a later mmap + touch of the file
    20-30 ms, not 3-7), 248-264 ms read forward first. Outside it nothing is advised: a lazy
    open that reads one small leaf cold reads ``read_ahead_kb`` around it, not 2 MiB.

    >>> with whole_file_mappings():
    ...     inside = _WHOLE_FILE.get()
    >>> inside, _WHOLE_FILE.get()
    (True, False)
    """

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _WHOLE_FILE.set(True)

    def __exit__(self, *exc: object) -> None:
        _WHOLE_FILE.reset(self._token)


def whole_file_load() -> bool:
    """Whether this runs inside :func:`whole_file_mappings` (a load of whole files).

    >>> whole_file_load()
    False
    """
    return _WHOLE_FILE.get()


#: The share of steps back, leaf to next leaf, that :func:`in_file_order` still calls forward
#: (a tied weight or a few keys out of place: one extra synchronous read each).
BACK_STEPS = 1 / 32


def in_file_order(offsets: np.ndarray, nbytes: np.ndarray | None = None) -> bool:
    """Whether leaves at ``offsets`` of one file, in the order they will be touched, read it
    forward: at most :data:`BACK_STEPS` of the steps from a leaf to the next go back (empty
    leaves, ``nbytes == 0``, left out). An int64 array of any length.

    >>> in_file_order(np.array([0, 64, 4096])), in_file_order(np.array([4096, 0, 64]))
    (True, False)
    """
    if nbytes is not None:
        offsets = offsets[nbytes > 0]
    steps = offsets.size - 1
    return steps < 1 or int(np.count_nonzero(offsets[1:] < offsets[:-1])) <= steps * BACK_STEPS


def advise_whole_file(mm: mmap.mmap | None, offsets: np.ndarray, nbytes: np.ndarray | None = None) -> bool:
    """Advises the read-only (or private) mapping ``mm`` of a whole file whose views a load made,
    the leaves at ``offsets`` in the order it lists them (see :func:`whole_file_mappings`):
    inside :func:`whole_file_mappings`, ``MADV_HUGEPAGE``, and where the leaves are not
    :func:`in_file_order`, the whole mapping read now, forward (``MADV_POPULATE_READ``: a file
    of at most half this machine's memory, on a kernel that has it, else no advice; not where
    most of it is cached already; nor for a file :func:`map_cached_ahead` took when it was
    mapped). Whether advice was given (never outside it, nor where the platform has no such
    advice; a refusal is not an error, and neither is a page the read cannot bring in).

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(bytes(PAGE_SIZE)); f.flush()
    ...     with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
    ...         advise_whole_file(mm, np.zeros(1, np.int64))  # not inside whole_file_mappings()
    False
    """
    if mm is None or not whole_file_load():
        return False
    if queued(mm) or in_file_order(offsets, nbytes):  # (queued: cached, see map_cached_ahead)
        return advise_huge_mapping(mm)
    populate = _POPULATE_READ if _populate_supported() else None
    if populate is None or len(mm) > _physical_memory() // 2 or not advise_huge_mapping(mm):
        return False
    if not _mostly_cached(mm):  # (a cached file: the touches only map its pages, in any order)
        libc.madvise(_address(mm), len(mm), populate)  # (False where a page cannot be read: the views say)
    return True


def map_cached_ahead(mm: mmap.mmap | None, fd: int) -> bool:
    """Inside :func:`whole_file_mappings`, as soon as a file is mapped (``fd``: its descriptor,
    still open): where the file is cached (:func:`~tdz_numba.files.pagecache.looks_cached`),
    ``MADV_HUGEPAGE`` and :func:`~tdz_numba.files.mapahead.map_ahead` now, so that the faults of
    the caller's first touches are taken on another core while the reader parses its headers and
    makes the views (what :func:`advise_whole_file` then decides for such a file, whatever the
    leaves' order, is that advice alone). Whether the mapping was queued.

    >>> map_cached_ahead(None, -1)
    False
    """
    if mm is None or not whole_file_load() or not map_ahead_on(len(mm)) or not looks_cached(fd, len(mm)):
        return False
    advise_huge_mapping(mm)
    return map_ahead(mm)


#: Pages of a mapping :func:`_mostly_cached` asks about (evenly spaced: ~1 us each).
CACHE_SAMPLE = 32


def _mostly_cached(mm: mmap.mmap) -> bool:
    """Whether at least half of :data:`CACHE_SAMPLE` pages spread over ``mm`` are in the page
    cache (``mincore``; False where it fails, or where the kernel does not say for a file this
    process may not write to: it then answers for this process's mapped pages only)."""
    mincore = libc.function("mincore")
    pages = len(mm) // PAGE_SIZE
    if mincore is None or not pages:
        return False
    base, vec, found = _address(mm), (ctypes.c_ubyte * 1)(), 0
    for page in np.linspace(0, pages - 1, min(CACHE_SAMPLE, pages)).astype(np.int64).tolist():
        if mincore(ctypes.c_void_p(base + page * PAGE_SIZE), ctypes.c_size_t(PAGE_SIZE), vec) != 0:
            return False
        found += vec[0] & 1
    return 2 * found >= min(CACHE_SAMPLE, pages)


def _physical_memory() -> int:
    """This machine's memory in bytes (1 GiB where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * PAGE_SIZE
    except (ValueError, OSError):  # pragma: no cover - no sysconf
        return 1 << 30
