"""Copies of a mapped file's byte spans into owned memory at memory speed.

Two costs make a copy of a model's tensors out of the page cache slower than ``memcpy``
between two resident buffers, and this module removes both:

* the destination's page faults: a fresh allocation is zero-filled one 4 KiB page per fault
  (131,072 faults for 512 MiB). :func:`advise_huge` asks for 2 MiB pages on a new allocation
  (``MADV_HUGEPAGE`` on the whole 2 MiB pages inside it, what numpy does for its own arrays
  of 4 MiB and more): 512 faults, each zero-filling 2 MiB;
* the copy itself: ``preadv`` copies in the kernel with plain stores, and so does the C
  library's ``memcpy`` below its own streaming threshold (~0.75x the last-level cache: every
  tensor of a model, on most machines). :func:`copy_spans` copies from the file's mapping
  with the :func:`~tdz_numba.files.page_kernels.copy_spans` kernel (non-temporal stores:
  the destination's lines are not read first) on ``num_threads`` threads, in pieces of
  :data:`PIECE` bytes taken in file order (a cold file is read forward).

Examples
--------
>>> import numpy as np
>>> from tdz_numba.files.copying import copy_spans
>>> src, dst = np.arange(100, dtype=np.uint8), np.zeros(8, np.uint8)
>>> col = lambda *v: np.array(v, np.int64)
>>> copy_spans(src, col(20, 90), col(dst.ctypes.data, dst.ctypes.data + 4), col(4, 4))
8
>>> dst.tolist()
[20, 21, 22, 23, 90, 91, 92, 93]
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import BadArchiveError
from . import libc
from .memory import advise_huge_mapping, inner_pages

__all__ = [
    "copy_spans",
    "advise_huge",
    "HUGE_PAGE",
    "HUGE_MIN",
    "PIECE",
    "STREAM_MIN",
    "MAX_THREADS",
    "RUN_SLACK",
    "still_mapped",
    "advise_huge_runs",
    "advise_source",
]

#: The transparent huge page size of x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20
#: Allocations of at least this many bytes get :func:`advise_huge` (numpy's own rule).
HUGE_MIN = 4 << 20
#: Bytes one kernel call copies at most (a thread's unit of work; larger spans are split).
PIECE = 8 << 20
#: Below this many bytes in all, one thread copies with plain stores (what the caller reads
#: next stays in the cache).
STREAM_MIN = 8 << 20
#: Bytes between two allocations that :func:`advise_huge_runs` still counts as one run.
RUN_SLACK = 4096 + 128
#: Threads a copy uses by default at most.
MAX_THREADS = 8
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def advise_huge(address: int, nbytes: int) -> int:
    """Asks for transparent huge pages on the whole 2 MiB pages inside ``[address, address +
    nbytes)`` of a fresh anonymous allocation (``MADV_HUGEPAGE``; the kernel's ``madvise``
    THP mode honours it; a page already touched stays as it is). Returns the bytes advised:
    0 below :data:`HUGE_MIN`, where no whole huge page lies inside, or where the platform
    refuses.

    >>> import numpy as np
    >>> advise_huge(np.empty(100, np.uint8).ctypes.data, 100)
    0
    """
    if _MADV_HUGEPAGE is None or nbytes < HUGE_MIN:
        return 0
    start, length = inner_pages(address, nbytes, HUGE_PAGE)
    return length if length and libc.madvise(start, length, _MADV_HUGEPAGE) else 0


def advise_huge_runs(addresses: np.ndarray, sizes: np.ndarray, slack: int = RUN_SLACK) -> int:
    """:func:`advise_huge` on the runs of fresh allocations that lie next to each other in the
    address space (at most ``slack`` bytes apart: the allocator's headers and page rounding):
    the C library places a batch of new allocations side by side and the kernel merges their
    mappings, so 2 MiB pages can straddle two leaves. A leaf of 1-4 MiB holds no whole 2 MiB
    page of its own, and one of 7 MiB wastes ~2 MiB on its edges: on a model's tensors, a third
    of the bytes. Returns the bytes advised.

    >>> import numpy as np
    >>> advise_huge_runs(np.array([4096], np.int64), np.array([100], np.int64))
    0
    """
    if _MADV_HUGEPAGE is None or sizes.size == 0:
        return 0
    order = np.argsort(addresses, kind="stable")
    starts, ends = addresses[order], addresses[order] + sizes[order]
    new_run = np.ones(starts.size, bool)
    new_run[1:] = (starts[1:] < ends[:-1]) | (starts[1:] - ends[:-1] > slack)
    first = np.flatnonzero(new_run)
    done = 0
    for a, b in zip(starts[first].tolist(), np.maximum.reduceat(ends, first).tolist()):
        done += advise_huge(a, b - a)
    return done


def still_mapped(mm: mmap.mmap, end: int) -> bool:
    """Whether the first ``end`` bytes of the file mapped by ``mm`` are still in the file (its
    size now, ``fstat`` of the mapping's descriptor, and the mapping's length): a copy from
    the mapping past the file's end would raise ``SIGBUS``, where ``preadv`` says "short
    read". A file truncated while the copy runs is the views' risk (a SIGBUS).

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(bytes(100)); f.flush()
    ...     with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
    ...         before = still_mapped(mm, 100)
    ...         _ = f.truncate(50)
    ...         print(before, still_mapped(mm, 100), still_mapped(mm, 50))
    True False True
    """
    try:
        return mm.size() >= end and len(mm) >= end
    except (OSError, ValueError):  # closed, or no descriptor kept
        return False


def advise_source(mapping: mmap.mmap) -> None:
    """``MADV_HUGEPAGE`` on the file mapping a large copy reads: a cold read then fills the page
    cache with 2 MiB folios (not the 4-128 KiB of fault read-around, one synchronous read each:
    a cold 512 MiB ``.tdz`` copied ~2x slower than by ``preadv`` without it), and a warm one
    maps them with one fault each (:func:`~tdz_numba.files.loadadvice.advise_whole_file`'s advice,
    which ``load(copy=True)`` mappings do not get)."""
    advise_huge_mapping(mapping)


def _mapping_of(buffer: np.ndarray) -> mmap.mmap | None:
    """The ``mmap`` a numpy view was made from (``np.frombuffer`` and slices of it), or None."""
    base = buffer.base
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return base if isinstance(base, mmap.mmap) else None


def _pieces(offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """Spans (sorted by source offset) cut into kernel calls of about :data:`PIECE` bytes: spans
    larger than it split, runs of smaller ones grouped."""
    big = sizes > PIECE
    if big.any():
        counts = np.where(big, -(-sizes // PIECE), 1)
        rep = np.repeat(np.arange(sizes.size), counts)
        first = np.cumsum(counts) - counts
        k = np.arange(rep.size) - first[rep]  # the piece's number inside its span
        offsets = offsets[rep] + k * PIECE
        addresses = addresses[rep] + k * PIECE
        sizes = np.minimum(sizes[rep] - k * PIECE, PIECE)
    cum = np.cumsum(sizes)
    group = (cum - sizes) // PIECE  # a span starts in piece number (bytes before it) // PIECE
    bounds = np.flatnonzero(np.diff(group)) + 1
    starts = [0, *bounds.tolist()]
    stops = [*bounds.tolist(), sizes.size]
    return [(offsets[a:b], addresses[a:b], sizes[a:b]) for a, b in zip(starts, stops)]


def copy_spans(
    buffer: np.ndarray,
    offsets: np.ndarray,
    addresses: np.ndarray,
    sizes: np.ndarray,
    num_threads: int | None = None,
    *,
    where: object = "",
) -> int:
    """Copies ``sizes[i]`` bytes of ``buffer`` (a uint8 mapping of a file) from ``offsets[i]`` to
    the owned memory at ``addresses[i]``, for every ``i``, on ``num_threads`` threads (None: the
    cores, :data:`MAX_THREADS` at most: a copy is bound by memory, not cores). Returns the bytes
    copied.

    The destinations are the caller's (fresh allocations of at least ``sizes[i]`` bytes each);
    the spans must lie inside ``buffer``, and inside the file a mapping ``buffer`` was made of
    (:func:`still_mapped`: a short read), else :class:`~tdz_numba.BadArchiveError` naming
    ``where`` is raised before anything is copied. Calls the Numba kernel: callers ask
    :func:`tdz_numba.jit.policy.use_kernels` first (the other path is ``preadv``).
    """
    from .page_kernels import copy_spans as kernel

    n = int(sizes.size)
    if n == 0:
        return 0
    offsets = np.ascontiguousarray(offsets, np.int64)
    addresses = np.ascontiguousarray(addresses, np.int64)
    sizes = np.ascontiguousarray(sizes, np.int64)
    limit = buffer.size
    bad = (offsets < 0) | (sizes < 0) | (offsets > limit) | (sizes > limit - offsets)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BadArchiveError(
            f"{where}: bytes [{int(offsets[i])}, {int(offsets[i]) + int(sizes[i])}) lie outside the "
            f"file's {limit} bytes (file truncated?)"
        )
    end = int((offsets + sizes).max())
    mapping = _mapping_of(buffer)
    if mapping is not None and not still_mapped(mapping, end):
        raise BadArchiveError(
            f"{where}: short read: the file no longer holds bytes up to {end} (truncated since it was opened?)"
        )
    total = int(sizes.sum())
    if mapping is not None and total >= STREAM_MIN:
        advise_source(mapping)
    order = np.argsort(offsets, kind="stable")
    offsets, addresses, sizes = offsets[order], addresses[order], sizes[order]
    if total < STREAM_MIN:
        return int(kernel(buffer, offsets, addresses, sizes, False))
    pieces = _pieces(offsets, addresses, sizes)
    workers = min(num_threads or min(os.cpu_count() or 1, MAX_THREADS), len(pieces))

    def one(piece: tuple[np.ndarray, ...]) -> int:
        return int(kernel(buffer, piece[0], piece[1], piece[2], True))

    if workers <= 1:
        return sum(map(one, pieces))
    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(one, pieces))
